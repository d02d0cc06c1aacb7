"""Tool calls in a model's text, per model family, and the prompt that offers tools to the model.

`tool_call_format(tokenizer)` picks the family's parser from the tokenizer (its chat template and its
vocabulary); each parser's `parse(text)` returns `(content, calls)`: the text outside the calls (stripped) and
the calls in order. `parse(text, first)` numbers the calls from `first` (the calls made before in the episode
or session) and the format mints their ids from that number (`call_id`): `call_<n>` for hermes and llama3, 9
digits for mistral (Mistral's chat templates refuse any id that is not 9 alphanumeric characters), so ids are
unique within an episode and deterministic. A malformed call raises `ToolCallError` (one line): JSON that does
not parse, a missing or empty name, arguments that are not an object, an unterminated call. Text without any
call parses to `(text.strip(), [])`.

- hermes (Qwen2.5 / Qwen3, Hermes, posttrain's tiny models): `<tool_call>{"name", "arguments"}</tool_call>`,
  any number per turn, content around them;
- mistral: `[TOOL_CALLS][{"name", "arguments"}, ...]`, content before it;
- llama3 (Llama 3.1-3.3 JSON tool calling): the whole reply is `{"name", "parameters"}` (optionally after
  `<|python_tag|>`; several separated by `;`); a reply that does not start with `{` is content.

`prefill(name)` is the text that opens a call in the family's format (of function `name`, or of any function
when `name` is None): the agent server puts it after the generation prompt for `tool_choice` "required" or a
named function, so the model must complete a call.

`render_tool_prompt` renders OpenAI-format messages and tools through the tokenizer's chat template;
assistant `tool_calls` whose `arguments` are a JSON string are handed to the template as the parsed
object (the form Hugging Face templates expect): `data.templates.template_messages`, the one normalisation
SFT rows get too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Protocol

from posttrain.data.templates import template_messages


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""
    name: str
    arguments: dict  # the parsed JSON object
    id: str  # minted by the format from the call's number in the episode (`call_id`)


class ToolCallError(ValueError):
    """A malformed tool call; `str(err)` is one line naming what is wrong."""


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str, first: int = 0) -> tuple[str, list[ToolCall]]: ...

    def call_id(self, n: int) -> str: ...

    def prefill(self, name: str | None) -> str: ...


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _call(obj, k: int, fmt: str, args_key: str = "arguments") -> ToolCall:
    """A ToolCall from a decoded JSON value (`{"name": ..., args_key: {...}}`), or ToolCallError."""
    if not isinstance(obj, dict):
        raise ToolCallError(f"{fmt} tool call {k}: expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(f"{fmt} tool call {k}: missing 'name' (a non-empty string), got keys "
                            f"{sorted(obj)}")
    arguments = obj.get(args_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{fmt} tool call {k} ({name}): '{args_key}' must be a JSON object, got "
                            f"{_short(json.dumps(arguments))}")
    return ToolCall(name, arguments, "")


class _Ids:
    """Ids `call_<n>`; `_numbered` gives a parse's calls the ids of numbers `first`, `first + 1`, ..."""

    def call_id(self, n: int) -> str:
        return f"call_{n}"

    def _numbered(self, calls: list[ToolCall], first: int) -> list[ToolCall]:
        return [replace(c, id=self.call_id(first + k)) for k, c in enumerate(calls)]


def _json(text: str, k: int, fmt: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ToolCallError(f"{fmt} tool call {k}: invalid JSON ({str(e).splitlines()[0]}) in "
                            f"{_short(text.strip())}") from None


class HermesFormat(_Ids):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several per turn (Qwen, Hermes)."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, first: int = 0) -> tuple[str, list[ToolCall]]:
        content, calls, pos = [], [], 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            end = text.find(self.CLOSE, start)
            if end < 0:
                raise ToolCallError(f"hermes tool call {len(calls)}: unterminated {self.OPEN} (no "
                                    f"{self.CLOSE}) in {_short(text[start:])}")
            content.append(text[pos:start])
            body = text[start + len(self.OPEN): end]
            calls.append(_call(_json(body, len(calls), self.name), len(calls), self.name))
            pos = end + len(self.CLOSE)
        content.append(text[pos:])
        return "".join(content).strip(), self._numbered(calls, first)

    def prefill(self, name: str | None) -> str:
        return self.OPEN + "\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments": ')


class MistralFormat(_Ids):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any content; ids of 9 digits."""
    name = "mistral"
    TAG = "[TOOL_CALLS]"

    def call_id(self, n: int) -> str:
        # Mistral's templates: "Tool call IDs should be alphanumeric strings with length 9!"
        return f"{n:09d}"

    def parse(self, text: str, first: int = 0) -> tuple[str, list[ToolCall]]:
        start = text.find(self.TAG)
        if start < 0:
            return text.strip(), []
        rest = text[start + len(self.TAG):].lstrip()
        try:
            value, end = json.JSONDecoder().raw_decode(rest)
        except ValueError as e:
            raise ToolCallError(f"mistral tool calls: invalid or unterminated JSON "
                                f"({str(e).splitlines()[0]}) in {_short(rest)}") from None
        value = value if isinstance(value, list) else [value]
        calls = [_call(v, k, self.name) for k, v in enumerate(value)]
        return (text[:start] + rest[end:]).strip(), self._numbered(calls, first)

    def prefill(self, name: str | None) -> str:
        return self.TAG + "[" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments": ')


class Llama3JsonFormat(_Ids):
    """The whole reply is `{"name": ..., "parameters": {...}}` (`;` between several), as Llama 3.1-3.3's
    JSON tool calling; `<|python_tag|>` before it is allowed. A reply not starting with `{` is content."""
    name = "llama3"
    TAG = "<|python_tag|>"

    def parse(self, text: str, first: int = 0) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        body = body[len(self.TAG):].lstrip() if tagged else body
        if not body.startswith("{"):
            if tagged:
                raise ToolCallError(f"llama3 tool call 0: expected a JSON object after {self.TAG}, got "
                                    f"{_short(body)}")
            return text.strip(), []
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while True:
            try:
                value, pos = decoder.raw_decode(body, pos)
            except ValueError as e:
                raise ToolCallError(f"llama3 tool call {len(calls)}: invalid or unterminated JSON "
                                    f"({str(e).splitlines()[0]}) in {_short(body[pos:])}") from None
            key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
            calls.append(_call(value, len(calls), self.name, key))
            rest = body[pos:].lstrip()
            if not rest:
                return "", self._numbered(calls, first)
            if not rest.startswith(";"):
                raise ToolCallError(f"llama3 tool call {len(calls) - 1}: unexpected text after the call: "
                                    f"{_short(rest)}")
            pos = len(body) - len(rest[1:].lstrip())

    def prefill(self, name: str | None) -> str:
        return "{" if name is None else '{"name": ' + json.dumps(name) + ', "parameters": '


FORMATS = {f.name: f for f in (HermesFormat(), MistralFormat(), Llama3JsonFormat())}


def tool_call_format(tokenizer) -> ToolCallFormat:
    """The tool-call format of `tokenizer`'s family, recognised from its chat template and vocabulary:
    `[TOOL_CALLS]` -> mistral, `<tool_call>` -> hermes, `<|python_tag|>` or a Llama 3 template that
    offers tools -> llama3. ValueError (one line) when none is recognised."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = "\n".join(str(t) for t in template.values())
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary view
        vocab = {}
    for name, marks in (("mistral", ["[TOOL_CALLS]"]), ("hermes", ["<tool_call>"]),
                        ("llama3", ["<|python_tag|>"])):
        if any(m in template or m in vocab for m in marks):
            return FORMATS[name]
    if "<|start_header_id|>" in template and "tools" in template:
        return FORMATS["llama3"]
    model = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    raise ValueError(f"tokenizer {model!s}: no known tool-call format in its chat template or vocabulary "
                     f"(known: {', '.join(FORMATS)}); use a model whose chat template renders tools")


def render_tool_prompt(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    """`apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)`, with
    assistant tool-call arguments given as JSON strings parsed into objects first."""
    return tokenizer.apply_chat_template(template_messages(messages), tools=tools or None,
                                         add_generation_prompt=True, tokenize=False)

