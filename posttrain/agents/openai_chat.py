"""The OpenAI chat-completions wire format of the agent server (`agents/openai_server.py`): a request's
messages, tools and `tool_choice` checked (`RequestError`: the HTTP status and one line), and a response
as one `chat.completion` object or as the `chat.completion.chunk` server-sent events of `stream: true`.

Messages: `{role, content}` with string content; an assistant message may carry `tool_calls`
(`[{id, type: "function", function: {name, arguments}}]`, arguments a JSON string or an object; its content
may then be null), and a `{"role": "tool", "tool_call_id", "content"}` message answers a call of an
earlier assistant message of the same request (400 otherwise, as OpenAI); its content may also be a list of
`{"type": "text", "text"}` parts (joined; another part type is a 400). Tools: OpenAI function specs
(`{"type": "function", "function": {"name", ...}}`). `tool_choice`: "auto" (the default with tools),
"none" (the default without), "required", or `{"type": "function", "function": {"name"}}` naming one of
the tools."""
from __future__ import annotations

import json
import time
from uuid import uuid4

from posttrain.rewards.server import check_text


class RequestError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def request_number(body: dict, key: str, default, low: float, high: float, integer: bool = False):
    """The request field `key` (`default` when absent), checked to be a number (an integer) in [low, high]."""
    value = body.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (integer and not isinstance(value, int))):
        raise RequestError(400, f"'{key}' must be a {'integer' if integer else 'number'}, got {value!r:.40}")
    if not low <= value <= high:
        raise RequestError(400, f"'{key}' must be in [{low:g}, {high:g}], got {value}")
    return value


def _tool_call_ids(m: dict, i: int) -> list[str]:
    """The ids of assistant message `i`'s `tool_calls`, their shape checked."""
    calls = m["tool_calls"]
    if not isinstance(calls, list):
        raise RequestError(400, f"messages[{i}].tool_calls must be a list of tool calls")
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c.get("id") if fn is not None else None, str) and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), (str, dict))):
            raise RequestError(400, f"messages[{i}].tool_calls[{k}] must be {{id, type: 'function', "
                                    f"function: {{name, arguments}}}} with a string id and name")
    return [c["id"] for c in calls]


def _tool_text(m: dict, i: int) -> dict:
    """Tool message `i` with a content of text parts joined into its text (OpenAI allows the parts)."""
    parts = m.get("content")
    if m.get("role") != "tool" or not isinstance(parts, list):
        return m
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in parts):
        raise RequestError(400, f"messages[{i}]: a tool message's content must be text or a list of "
                                f"{{type: 'text', text}} parts")
    return {**m, "content": "".join(p["text"] for p in parts)}


def chat_messages(body: dict) -> list[dict]:
    """The request's messages, checked (module docstring); tool messages' text parts joined."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects")
    messages = [_tool_text(m, i) if isinstance(m, dict) else m for i, m in enumerate(messages)]
    called: set[str] = set()
    for i, m in enumerate(messages):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or (calls and m.get("content") is None))):
            raise RequestError(400, f"messages[{i}] must be an object with string 'role' and 'content'")
        try:
            check_text([m["role"], m.get("content") or ""], f"messages[{i}] role/content")
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        if calls:
            called.update(_tool_call_ids(m, i))
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(400, f"messages[{i}]: a tool message needs 'tool_call_id', the id of the "
                                        f"assistant tool call it answers")
            if m["tool_call_id"] not in called:
                raise RequestError(400, f"messages[{i}]: tool_call_id {m['tool_call_id']!r:.60} answers no "
                                        f"tool call of an earlier assistant message")
    return messages


def chat_tools(body: dict) -> tuple[list[dict] | None, str, str | None]:
    """(tools or None, tool_choice mode: "auto" / "none" / "required" / "function", the named function)."""
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function"
                and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
                for t in tools):
            raise RequestError(400, "'tools' must be a list of {type: 'function', function: {name, "
                                    "description, parameters}}")
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none", None
    if tools is None and choice != "none":
        raise RequestError(400, f"'tool_choice' {choice!r:.60} needs 'tools'")
    if choice in ("auto", "none", "required"):
        return tools, choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise RequestError(400, f"'tool_choice' must be 'auto', 'none', 'required' or {{type: 'function', "
                                f"function: {{name}}}}, got {choice!r:.60}")
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(400, f"'tool_choice' names function {name!r:.60}, which is not in 'tools'")
    return tools, "function", name


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream, options = body.get("stream", False), body.get("stream_options") or {}
    if not isinstance(stream, bool):
        raise RequestError(400, f"'stream' must be true or false, got {stream!r:.40}")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(400, "'stream_options' must be an object like {\"include_usage\": true}")
    return stream, bool(options.get("include_usage"))


def openai_tool_calls(calls) -> list[dict]:
    """The parsed `ToolCall`s as OpenAI's `message.tool_calls` (their ids, minted by the family's format)."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def completion(model: str, message: dict, finish: str, logprobs, usage: dict, token_ids: dict,
               error: str | None) -> dict:
    """One `chat.completion` (and posttrain's `token_ids`; `tool_call_error` for a malformed call)."""
    choice = {"index": 0, "message": message, "finish_reason": finish,
              "logprobs": {"content": logprobs} if logprobs else None}
    if error:
        choice["tool_call_error"] = error
    return {"id": f"chatcmpl-{uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage, "token_ids": token_ids}


def stream_events(response: dict, pieces: list[str], include_usage: bool):
    """The SSE lines of `response` streamed: the role, the content in `pieces` (joined: the content), each
    tool call (index, id, name, arguments), the finish reason with the log-probs and posttrain's
    `token_ids`, the usage (when asked), `[DONE]`."""
    choice = response["choices"][0]
    head = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def event(delta: dict, top: dict | None = None, **fields) -> str:
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None} | fields]
        return f"data: {json.dumps(head | {'choices': choices} | (top or {}))}\n\n"

    yield event({"role": "assistant", "content": ""})
    for piece in pieces:
        yield event({"content": piece})
    for k, call in enumerate(choice["message"].get("tool_calls") or ()):
        yield event({"tool_calls": [{"index": k} | call]})
    last = {k: choice[k] for k in ("finish_reason", "logprobs", "tool_call_error") if k in choice}
    yield event({}, {"token_ids": response["token_ids"]}, **last)
    if include_usage:
        yield f"data: {json.dumps(head | {'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"
