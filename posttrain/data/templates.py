"""Prompt templates: plain ``--data.input_template`` format strings and tokenizer chat templates."""

from __future__ import annotations

import json
import os
from typing import Any

from .errors import DataError


def check_input_template(template: str | None) -> str | None:
    """Validate ``--data.input_template``: a ``str.format`` string with exactly one ``{}`` slot."""
    if template is None:
        return None
    try:
        probe = template.format("\x00")
    except (IndexError, KeyError, ValueError) as e:
        raise DataError(
            f"--data.input_template {template!r}: not a valid format string ({type(e).__name__}: {e}); "
            f"use one '{{}}' where the input goes and '{{{{'/'}}}}' for literal braces."
        ) from e
    if probe.count("\x00") != 1:
        raise DataError(
            f"--data.input_template {template!r}: must contain exactly one '{{}}' where the input text goes, "
            f"e.g. $'User: {{}}\\nAssistant: '."
        )
    return template


def format_prompt(template: str | None, text: str) -> str:
    """``template.format(text)``, or ``text`` when no template is set."""
    return text if template is None else template.format(text)


def set_chat_template(tokenizer: Any, template: str | None) -> Any:
    """Apply ``--data.tokenizer_chat_template``: a Jinja string, or a path to a file holding one,
    replaces ``tokenizer.chat_template``. None leaves the tokenizer unchanged."""
    if template is None:
        return tokenizer
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    if "{%" not in template and "{{" not in template:
        raise DataError(
            f"--data.tokenizer_chat_template: {template[:80]!r} is neither an existing file nor a Jinja "
            f"template (no '{{%' or '{{{{' found)."
        )
    tokenizer.chat_template = template
    return tokenizer


def require_chat_template(tokenizer: Any) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "--data.apply_chat_template: the tokenizer has no chat template; pass "
            "--data.tokenizer_chat_template <jinja string or file>, or drop --data.apply_chat_template "
            "and use --data.input_template."
        )


def to_messages(value: str | list[dict], role: str) -> list[dict]:
    """A text field becomes one message of ``role``; a message list is returned as a copy."""
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def template_messages(messages: list[dict]) -> list[dict]:
    """``messages`` as chat templates expect them: an assistant turn's ``tool_calls`` whose ``arguments`` are
    a JSON string (OpenAI's wire format) get the parsed object (Hugging Face templates ``tojson`` it; the
    string would be encoded twice); a string that is not JSON stays. One normalisation for SFT rows and the
    agent server (``agents/tool_calls.render_tool_prompt``)."""
    return [_template_message(m) for m in messages]


def _template_message(message: dict) -> dict:
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function", call))
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # left as the string given
        out.append({**call, "function": fn} if "function" in call else fn)
    return {**message, "tool_calls": out}


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, location: str = "",
                tools: list[dict] | None = None) -> str:
    """The chat template applied to ``messages`` (normalised by ``template_messages``) as text (not
    tokenised), with ``tools`` (OpenAI-format function schemas) when given; ``location`` prefixes errors."""
    try:
        return tokenizer.apply_chat_template(
            template_messages(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {})
        )
    except Exception as e:
        prefix = f"{location}: " if location else ""
        raise DataError(
            f"{prefix}the chat template failed on {len(messages)} message(s) ({type(e).__name__}: {e}). "
            f"Fix the data or pass a suitable --data.tokenizer_chat_template."
        ) from e
