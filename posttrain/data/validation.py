"""Up-front checks of row fields; every failure names the file, row, key and the fix."""

from __future__ import annotations

import difflib
from typing import Any

from .errors import DataError, where

Row = dict[str, Any]
MARGIN_KEY = "margin"  # the key of each row's margin, which RM's --model.margin_loss_enable reads


def _user_keys(row: Row) -> list[str]:
    return sorted(k for k in row if not (k.startswith("__") and k.endswith("__")))


def close_key(key: str, keys) -> str | None:
    """The one of ``keys`` closest to the missing ``key`` (difflib: a typo, another case), or None."""
    lowered = {k.lower(): k for k in keys if isinstance(k, str)}
    match = difflib.get_close_matches(key.lower(), lowered, n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


def get_field(row: Row, key: str, flag: str) -> Any:
    """``row[key]``, or DataError listing the keys the row has, the closest one, and the flag that picks
    the key."""
    if key not in row:
        keys = _user_keys(row)
        close = close_key(key, keys)
        hint = f" Did you mean '{close}'?" if close else ""
        raise DataError(
            f"{where(row)}: missing key '{key}' (the row has keys {keys}).{hint} Fix the data, "
            f"or pass {flag} <key> naming the field to use."
        )
    return row[key]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def require_text(row: Row, key: str, flag: str) -> str:
    """A non-empty string field."""
    value = get_field(row, key, flag)
    if not isinstance(value, str):
        raise DataError(
            f"{where(row)}: key '{key}' must be text (a string), got {type(value).__name__} {_short(value)}. "
            f"Fix the data (e.g. quote the value), or pass {flag} to pick another field."
        )
    if not value.strip():
        raise DataError(
            f"{where(row)}: key '{key}' is empty text. Fix the data (fill it in or remove the row)."
        )
    return value


def _content_ok(content: Any) -> bool:
    """Text, or a list of typed parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``: images)."""
    return isinstance(content, str) or (
        isinstance(content, list)
        and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content))


def check_messages(row: Row, key: str, value: Any, flag: str) -> list[dict]:
    """A non-empty list of ``{"role": str, "content": str | list of typed parts}`` dicts."""
    shape = 'a list of {"role": ..., "content": ...} messages'
    if not isinstance(value, list):
        raise DataError(
            f"{where(row)}: key '{key}' must be {shape}, got {type(value).__name__} {_short(value)}. "
            f"Fix the data, or pass {flag} to pick another field."
        )
    if not value:
        raise DataError(f"{where(row)}: key '{key}' is an empty message list. Fix the data.")
    for i, msg in enumerate(value):
        calls = isinstance(msg, dict) and msg.get("tool_calls") not in (None, [])  # [] = no calls
        if (
            not isinstance(msg, dict)
            or not isinstance(msg.get("role"), str)
            or not (_content_ok(msg.get("content")) or (calls and msg.get("content") is None))
        ):
            raise DataError(
                f"{where(row)}: key '{key}', message {i} must be a dict with string 'role' and 'content' "
                f"(text, or a list of typed parts for images; null or absent beside 'tool_calls'), "
                f"got {_short(msg)}. Fix the data ({shape})."
            )
        if calls and not _tool_calls_ok(msg["tool_calls"]):
            raise DataError(
                f"{where(row)}: key '{key}', message {i}: 'tool_calls' must be a list of "
                f'{{"type": "function", "function": {{"name": str, "arguments": object or JSON string}}}}, '
                f"got {_short(msg['tool_calls'])}. Fix the data."
            )
    return value


def _tool_calls_ok(calls: Any) -> bool:
    """OpenAI's shape: ``[{"id"?, "type": "function", "function": {"name", "arguments"}}]``."""
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str) and c["function"]["name"] != ""
        and isinstance(c["function"].get("arguments", {}), (dict, str))
        for c in calls)


def require_messages(row: Row, key: str, flag: str) -> list[dict]:
    return check_messages(row, key, get_field(row, key, flag), flag)


def require_text_or_messages(row: Row, key: str, flag: str) -> str | list[dict]:
    """Text (non-empty string) or a message list — the two shapes a chat-template field may take."""
    value = get_field(row, key, flag)
    if isinstance(value, list):
        return check_messages(row, key, value, flag)
    if not isinstance(value, str):
        raise DataError(
            f"{where(row)}: key '{key}' must be text or a list of {{role, content}} messages, got "
            f"{type(value).__name__} {_short(value)}. Fix the data, or pass {flag} to pick another field."
        )
    return require_text(row, key, flag)


def ensure_location(rows: list[Row], source: str = "<rows>") -> list[Row]:
    """Rows built in memory get ``__source__``/``__row__`` (1-based list index) so errors can name them."""
    out = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DataError(f"{source}, row {i}: expected a dict, got {type(row).__name__}. Fix the data.")
        if "__row__" not in row:
            row = {**row, "__source__": row.get("__source__", source), "__row__": i}
        out.append(row)
    return out
