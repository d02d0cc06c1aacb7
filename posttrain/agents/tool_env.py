"""Tool environments (`--train.tool_path FILE`): multi-turn episodes from a file of plain Python functions,
with no agent loop to write.

The file: its public functions (the ones it defines, not those it imports; or exactly the list
`TOOLS = [...]` when it has one) are the tools. Each needs type hints on every argument and a docstring
with a description and an `Args:` entry per argument: its JSON schema comes from
`transformers.utils.get_json_schema`, as for `apply_chat_template(tools=...)`. A function without them stops
the run at start-up, before any model loads, with one line naming the function and what is missing.
Optional settings: `SYSTEM_PROMPT` (a system turn before every prompt), `MAX_TOOL_CALLS` (calls per
episode, default 4), `TOOL_TIMEOUT` (seconds per call, default 10), `MAX_TOOL_OUTPUT` (characters of a
call's output, default 1000: longer output is cut, with a marker saying how much).

A call runs on a daemon thread of its own. Past its timeout the episode stops waiting and the result is
abandoned (a Python thread cannot be killed: a hung function keeps its thread until it returns, but never
holds up the episode, the step or the run's exit). An exception, a timeout, an unknown tool, arguments
that do not fit the function and a malformed call (`ToolCallError`) each become the tool message's text
(one line, `error: ...`) and count in `tool_errors`; none ends the episode or the run.

The episode is `MultiTurnAgentExecutor`'s loop (one implementation) over `ToolInstance`: the prompt is
rendered with the tools' schemas (the prompt dataset renders it: `ToolFile.schemas`, `system_prompt`),
each turn's text is parsed with the model's tool-call format (`tool_calls.tool_call_format`), the calls
run, and their tool messages are appended as the chat template renders them (context: no gradient). The
episode ends when the model answers without a tool call, when a turn runs out of tokens, when a call would
exceed `MAX_TOOL_CALLS`, or when the budget (--data.max_len) is spent. Its reward is None: the run's reward
source scores the prompt followed by the model's last turn (its final answer; `reward_ids` of the result),
with the row's label. `extra_logs`: `tool_calls` and `tool_errors` (logged as `reward/tool_calls`, ...);
malformed calls also count in `agent/tool_call_errors`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import os
import threading
from dataclasses import dataclass, field

from posttrain.agents.agent_api import AgentInstanceBase, MultiTurnAgentExecutor
from posttrain.agents.tool_calls import ToolCallError, tool_call_format
from posttrain.compat.user_files import exec_user_file
from posttrain.utils.errors import UserError

FLAG = "--train.tool_path"
SETTINGS = {"MAX_TOOL_CALLS": 4, "TOOL_TIMEOUT": 10.0, "MAX_TOOL_OUTPUT": 1000}
_SENTINEL = "\x00posttrain-end-of-turn\x00"


class ToolFileError(UserError):
    pass


@dataclass
class ToolFile:
    """A loaded tool file: `functions` by name, their OpenAI-format `schemas`, and its settings."""
    path: str
    functions: dict
    schemas: list[dict]
    system_prompt: str | None = None
    max_tool_calls: int = SETTINGS["MAX_TOOL_CALLS"]
    timeout: float = SETTINGS["TOOL_TIMEOUT"]
    max_output: int = SETTINGS["MAX_TOOL_OUTPUT"]
    names: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.names = list(self.functions)

    async def run(self, name: str, arguments) -> tuple[str, bool]:
        """(the tool message's text, whether the call succeeded) of one call; never raises."""
        fn = self.functions.get(name)
        if fn is None:
            return f"error: unknown tool {name!r} (tools: {', '.join(self.names)})", False
        if not isinstance(arguments, dict):
            return f"error: {name}: arguments must be a JSON object, got {type(arguments).__name__}", False
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as err:
            return f"error: {name}: {err}", False
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call():
            try:
                try:
                    done.set_result(fn(**arguments))
                except BaseException as err:  # SystemExit too: an error of this call, not an exit of the run
                    done.set_exception(err)
            except concurrent.futures.InvalidStateError:  # abandoned past its timeout: nobody waits
                pass

        threading.Thread(target=call, name=f"posttrain-tool-{name}", daemon=True).start()
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(done), self.timeout)
        except asyncio.TimeoutError:
            return f"error: {name} timed out after {self.timeout:g} s", False
        except BaseException as err:
            return _one_line(f"error: {name} raised {type(err).__name__}: {err}"), False
        return self.cut(result if isinstance(result, str) else _as_text(result)), True

    def cut(self, text: str) -> str:
        """`text` within `max_output` characters, with a marker when cut."""
        if len(text) <= self.max_output:
            return text
        return f"{text[:self.max_output]}... [cut: {len(text) - self.max_output} more characters]"


def _as_text(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def load_tool_file(path: str, tokenizer=None) -> ToolFile:
    """The tools of `path` (module docstring); every problem is a ToolFileError naming the file, and so is
    a `tokenizer` (when given) whose chat template has no known tool-call format."""
    from transformers.utils import get_json_schema

    if not str(path).endswith(".py"):
        raise ToolFileError(f"{FLAG} {path}: a tool file must be a .py file of functions")
    if not os.path.isfile(path):
        raise ToolFileError(f"{FLAG} {path}: file not found (resolved to {os.path.abspath(path)})")
    try:
        module = exec_user_file(path, "posttrain_tools_")
    except Exception as e:
        raise ToolFileError(f"{FLAG} {path}: importing it raised {type(e).__name__}: "
                            f"{_one_line(str(e))}") from e
    listed = getattr(module, "TOOLS", None)
    if listed is None:
        listed = [v for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                  and v.__module__ == module.__name__]
    if not listed or not all(callable(f) for f in listed):
        raise ToolFileError(f"{FLAG} {path}: no tools: define public functions (or TOOLS = [f, ...] of "
                            f"functions)")
    schemas = []
    for fn in listed:
        try:
            schemas.append({"type": "function", "function": get_json_schema(fn)["function"]})
        except Exception as e:
            raise ToolFileError(f"{FLAG} {path}: tool {getattr(fn, '__name__', fn)!r}: {_one_line(str(e))}; "
                                f"give every argument a type hint and the docstring an Args: entry "
                                f"for it") from None
    system = getattr(module, "SYSTEM_PROMPT", None)
    if system is not None and not isinstance(system, str):
        raise ToolFileError(f"{FLAG} {path}: SYSTEM_PROMPT must be a string, got {type(system).__name__}")
    if tokenizer is not None:
        try:
            tool_call_format(getattr(tokenizer, "tokenizer", tokenizer))
        except ValueError as e:
            raise ToolFileError(f"{FLAG} {path}: {e}") from None
    return ToolFile(path, {s["function"]["name"]: fn for s, fn in zip(schemas, listed)}, schemas, system,
                    _setting(module, path, "MAX_TOOL_CALLS"), float(_setting(module, path, "TOOL_TIMEOUT")),
                    _setting(module, path, "MAX_TOOL_OUTPUT"))


def _setting(module, path: str, key: str):
    value = getattr(module, key, SETTINGS[key])
    kind = (int, float) if key == "TOOL_TIMEOUT" else int
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        raise ToolFileError(f"{FLAG} {path}: {key} = {value!r}: must be a positive "
                            f"{'number' if key == 'TOOL_TIMEOUT' else 'integer'}")
    return value


class ToolInstance(AgentInstanceBase):
    """One tool episode's environment (module docstring): parses each turn, runs its calls, and gives
    their tool messages as the chat template renders them after the model's turn."""

    def __init__(self, tools: ToolFile, tokenizer):
        self.tools, self.tokenizer = tools, getattr(tokenizer, "tokenizer", tokenizer)
        self.format = tool_call_format(self.tokenizer)
        self.calls = self.errors = self.malformed = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        text, ids = states["action_text"], list(states.get("action_token_ids") or ())
        ended = states.get("finish_reason", "stop") == "stop"  # a turn cut by its token cap is final
        try:
            content, calls = self.format.parse(text) if ended else (text, [])
            malformed = None
        except ToolCallError as err:
            content, calls, malformed = text, [], str(err)
        if (not calls and malformed is None) or self.calls + max(len(calls), 1) > self.tools.max_tool_calls:
            return self._result("", done=True)  # the final answer, or a call past the cap
        if malformed is not None:
            self.calls, self.errors, self.malformed = self.calls + 1, self.errors + 1, self.malformed + 1
            assistant = {"role": "assistant", "content": text}
            replies = [{"role": "tool", "tool_call_id": "call_0",
                        "content": _one_line(f"error: {malformed}")}]
        else:
            assistant = {"role": "assistant", "content": content,
                         "tool_calls": [{"id": c.id, "type": "function",
                                         "function": {"name": c.name, "arguments": c.arguments}}
                                        for c in calls]}
            replies = []
            for c in calls:
                out, ok = await self.tools.run(c.name, c.arguments)
                self.calls, self.errors = self.calls + 1, self.errors + (not ok)
                replies.append({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": out})
        stop = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ended else ""
        return self._result(self.feedback(assistant, replies, stop), done=False)

    def _result(self, feedback: str, done: bool) -> dict:
        return {"rewards": None, "scores": None, "environment_feedback": feedback, "done": done,
                "extra_logs": {"tool_calls": float(self.calls), "tool_errors": float(self.errors),
                               "malformed_calls": self.malformed}}

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools.schemas, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def feedback(self, assistant: dict, replies: list[dict], stop_text: str) -> str:
        """The text after the model's turn (which ended with `stop_text`, the end-of-turn token it sampled):
        the rest of the template's end of an assistant turn, the tool messages and the next generation
        prompt, cut from renderings of a one-question conversation."""
        head = [{"role": "user", "content": "?"}]
        marked = self.render([*head, {"role": "assistant", "content": _SENTINEL}], False)
        closing = marked[marked.rindex(_SENTINEL) + len(_SENTINEL):]
        before = self.render([*head, assistant], False)
        after = self.render([*head, assistant, *replies], True)
        if not after.startswith(before):
            raise ValueError(f"{FLAG}: the chat template renders tool messages by changing the turns before "
                             f"them; pass a --data.tokenizer_chat_template that renders turns incrementally")
        lead = closing[len(stop_text):] if stop_text and closing.startswith(stop_text) else closing
        return lead + after[len(before):]


class ToolAgentExecutor(MultiTurnAgentExecutor):
    """`MultiTurnAgentExecutor` over a tool file's `ToolInstance`s; its results carry `reward_ids`, the prompt
    followed by the model's last turn, which the run's reward source scores, and `tool_call_errors`, the
    episode's malformed calls (`agent/tool_call_errors`, as the OpenAI-compatible server counts them)."""

    def __init__(self, tools: ToolFile):
        super().__init__(ToolInstance)
        self.tools = tools

    def new_instance(self, hf_tokenizer) -> ToolInstance:
        return ToolInstance(self.tools, hf_tokenizer)

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        result = await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                                       images)
        tokens, (start, end) = result["observation_tokens"], result["action_ranges"][-1]
        result["reward_ids"] = tokens[:result["prompt_length"]] + tokens[start:end]
        result["tool_call_errors"] = result["extra_logs"].pop("malformed_calls")  # agent/tool_call_errors
        return result
