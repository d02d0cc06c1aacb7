"""Cutting text fields to what `--data.max_len` can use, before tokenisation.

A row's text can be far longer than any sample (one 50 MB JSON line would be tokenised whole, at
gigabytes of peak memory, only for all but its first `max_len` tokens to be cut or the row dropped).
One token covers at most C characters, C the length of the longest entry of the tokenizer's vocabulary
(`chars_per_token`), so the first `max_len × C` characters of a field hold at least `max_len` tokens.
A field is cut at twice that, `text_limit = 2 × max_len × C` characters, so the word cut at the end is
far past every token a sample keeps: the samples stay as they were (their tokens up to `max_len` come
from the same text; a prompt that fills `max_len` still does). Each field the dataset tokenises is
cut: text, or the `content` of each message of a message list; other fields (labels, margins) are never
touched. The rows cut are counted and reported."""
from __future__ import annotations

from collections.abc import Iterable

CHARS_PER_TOKEN = 128  # the bound when the tokenizer's vocabulary cannot be read


def chars_per_token(tokenizer) -> int:
    """The most characters one token of `tokenizer` covers: its longest vocabulary entry (a byte-level
    entry has one character per byte, so it bounds the text characters too)."""
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except Exception:  # noqa: BLE001 (a tokenizer without a readable vocabulary)
        return CHARS_PER_TOKEN


def text_limit(max_len: int, tokenizer) -> int:
    """The characters of one field kept for samples of `max_len` tokens (module docstring)."""
    return 2 * max_len * chars_per_token(tokenizer)


def _cap(value, limit: int):
    if isinstance(value, str):
        return value[:limit] if len(value) > limit else value
    if isinstance(value, list) and any(isinstance(m, dict) and isinstance(m.get("content"), str)
                                       and len(m["content"]) > limit for m in value):
        return [{**m, "content": m["content"][:limit]} if isinstance(m, dict)
                and isinstance(m.get("content"), str)
                and len(m["content"]) > limit else m for m in value]
    return value


def cap_text_fields(rows: list[dict], keys: Iterable[str | None], max_len: int,
                    tokenizer) -> tuple[list[dict], int]:
    """(rows with each field of `keys` cut to `text_limit(max_len, tokenizer)` characters, how many rows
    were cut); a cut row is a copy (its location kept), the others are the same objects."""
    limit, keys = text_limit(max_len, tokenizer), [k for k in keys if k]
    out, cut = [], 0
    for row in rows:
        changed = None
        for key in keys:
            value = row.get(key) if isinstance(row, dict) else None
            new = _cap(value, limit)
            if new is not value:
                changed = changed if changed is not None else dict(row)
                changed[key] = new
        out.append(row if changed is None else changed)
        cut += changed is not None
    return out, cut


def capped_note(what: str, count: int, max_len: int, tokenizer, budget: str | None = None) -> str:
    """The start-up line reporting `count` rows whose text was cut (module docstring); `budget` names
    `max_len` (default: --data.max_len)."""
    budget = budget or f"--data.max_len {max_len}"
    return (f"{what}: {count} rows have a text field longer than {text_limit(max_len, tokenizer)} characters "
            f"(2 x {budget} x {chars_per_token(tokenizer)}, the longest token's characters): cut to that "
            f"before tokenising, which changes no sample")
