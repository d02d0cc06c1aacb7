"""Tool environments (`--train.tool_path FILE`): multi-turn episodes from a file of plain Python functions,
with no agent loop to write.

The file: its public functions (the ones it defines, not those it imports; or exactly the list `TOOLS = [...]`
when it has one) are the tools, one per name (two with the same `__name__` stop the run at start-up). Each
needs type hints on every argument and a docstring with a description and an `Args:` entry per argument: its
JSON schema comes from `transformers.utils.get_json_schema`, as for `apply_chat_template(tools=...)`. A
function without them stops the run at start-up, before any model loads, with one line naming the function and
what is missing. Optional settings: `SYSTEM_PROMPT` (a system turn before every prompt), `MAX_TOOL_CALLS`
(calls per episode, default 4), `TOOL_TIMEOUT` (seconds per call, default 10), `MAX_TOOL_OUTPUT` (characters
of a call's output, default 1000: longer output is cut, with a marker saying how much).

Per-episode state (TRL's `environment_factory`): `ENVIRONMENT = SomeClass` makes the tools the public
methods of that class (all but `reset`; inherited, static and class methods too), with the same hint and
docstring rules; one instance per episode (built with no arguments), whose `reset(prompt=..., label=...)`,
when it has one, runs before the episode's first turn with the prompt as rendered (chat template and tools
applied) and the row's label (None without --data.label_key). `reset` returns None: an initial observation
belongs in the prompt dataset, and one returned fails the episode naming the file, as does what the
constructor or `reset` raises (one line). The class is built once at load, so a constructor that raises, a
`reset` that does not take `prompt` and `label`, and a `get_reward` method (the run's reward source scores
the episode) stop the run at start-up; a file sets `TOOLS` or `ENVIRONMENT`, not both.

A call runs on a daemon thread of its own; an `async def` tool's coroutine runs there to its end
(`asyncio.run`). Past its timeout the episode stops waiting and the result is abandoned (a Python thread
cannot be killed: a hung function keeps its thread until it returns, but never holds up the episode, the
step or the run's exit). Such a call is stuck while its thread runs: `stuck_calls` counts them (logged as
`reward/tool_stuck`), and once `MAX_STUCK` (4, as `--reward.func_path`'s reward_func calls) of them run, no
call starts: `ToolsStuck` stops the run with one line naming the tool. An exception, a timeout, an
unknown tool, arguments that do not fit the function and a malformed call (`ToolCallError`) each become
the tool message's text (one line, `error: ...`, within the `MAX_TOOL_OUTPUT` budget as any output) and
count in `tool_errors`; none ends the episode or the run.

The episode is `MultiTurnAgentExecutor`'s loop (one implementation) over `ToolInstance`: the prompt is
rendered with the tools' schemas (the prompt dataset renders it: `ToolFile.schemas`, `system_prompt`), each
turn's text is parsed with the model's tool-call format (`tool_calls.tool_call_format`; call ids are the
format's, numbered over the episode), the calls run, and their tool messages are appended as the chat template
renders them (context: no gradient). The episode ends when the model answers without a tool call, when a turn
runs out of tokens, when a call would exceed `MAX_TOOL_CALLS`, or when the budget (--data.max_len) is spent.
Its reward is None: the run's reward source scores the prompt followed by the model's last turn (its final
answer; `reward_ids` of the result), with the row's label. `extra_logs`: `tool_calls`, `tool_errors` and
`tool_stuck` (logged as `reward/tool_calls`, ...); malformed calls also count in `agent/tool_call_errors`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import threading
from dataclasses import dataclass, field

from posttrain.agents.agent_api import AgentInstanceBase, MultiTurnAgentExecutor
from posttrain.agents.tool_calls import ToolCallError, tool_call_format
from posttrain.compat.user_files import UserFileExit, import_user_file
from posttrain.config.serving import DEFAULT_MAX_STUCK as MAX_STUCK
from posttrain.utils.errors import UserError

FLAG = "--train.tool_path"
SETTINGS = {"MAX_TOOL_CALLS": 4, "TOOL_TIMEOUT": 10.0, "MAX_TOOL_OUTPUT": 1000}
_SENTINEL = "\x00posttrain-end-of-turn\x00"


class ToolFileError(UserError):
    pass


class ToolsStuck(UserFileExit):
    """MAX_STUCK timed-out calls still run: the run stops (the agent runner stops on a UserFileExit)."""

    def __init__(self, message: str) -> None:
        RuntimeError.__init__(self, message)
        self.code = None


@dataclass
class ToolFile:
    """A loaded tool file: `functions` by name, their OpenAI-format `schemas`, and its settings."""
    path: str
    functions: dict  # name -> function; with `environment`, the methods of the instance built at load
    schemas: list[dict]
    system_prompt: str | None = None
    environment: type | None = None  # ENVIRONMENT: one instance per episode, its bound methods the tools
    max_tool_calls: int = SETTINGS["MAX_TOOL_CALLS"]
    timeout: float = SETTINGS["TOOL_TIMEOUT"]
    max_output: int = SETTINGS["MAX_TOOL_OUTPUT"]
    names: list[str] = field(init=False)
    stuck: list = field(init=False, default_factory=list)  # threads of timed-out calls, pruned when they end

    def __post_init__(self) -> None:
        self.names = list(self.functions)
        self._lock = threading.Lock()

    @property
    def stuck_calls(self) -> int:
        """Timed-out calls whose thread still runs."""
        with self._lock:
            self.stuck = [t for t in self.stuck if t.is_alive()]
            return len(self.stuck)

    async def run(self, name: str, arguments, functions: dict | None = None) -> tuple[str, bool]:
        """(the tool message's text, whether the call succeeded) of one call to `functions[name]` (default
        the file's functions; an episode's environment passes its bound methods); raises only ToolsStuck."""
        if functions is None and self.environment is not None:
            raise TypeError("an ENVIRONMENT's tools run on an episode's instance: pass its `functions`")
        fn = (self.functions if functions is None else functions).get(name)
        if fn is None:
            return self.error(f"unknown tool {name!r} (tools: {', '.join(self.names)})"), False
        if not isinstance(arguments, dict):
            return self.error(f"{name}: arguments must be a JSON object, got "
                              f"{type(arguments).__name__}"), False
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as err:
            return self.error(f"{name}: {err}"), False
        if (stuck := self.stuck_calls) >= MAX_STUCK:
            raise ToolsStuck(f"{stuck} timed-out tool calls ({', '.join(t.name for t in self.stuck)}) still "
                             f"run past TOOL_TIMEOUT {self.timeout:g} s in {self.path} (a thread cannot be "
                             f"killed), so no call starts; fix the hang in the tool and restart")
        done: concurrent.futures.Future = concurrent.futures.Future()

        def call():
            try:
                try:
                    result = fn(**arguments)
                    done.set_result(asyncio.run(result) if inspect.iscoroutine(result) else result)
                except BaseException as err:  # SystemExit too: an error of this call, not an exit of the run
                    done.set_exception(err)
            except concurrent.futures.InvalidStateError:  # abandoned past its timeout: nobody waits
                pass

        thread = threading.Thread(target=call, name=f"posttrain-tool-{name}", daemon=True)
        thread.start()
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(done), self.timeout)
        except asyncio.TimeoutError:
            with self._lock:
                self.stuck.append(thread)
            return self.error(f"{name} timed out after {self.timeout:g} s"), False
        except BaseException as err:
            return self.error(f"{name} raised {type(err).__name__}: {err}"), False
        return self.cut(result if isinstance(result, str) else _as_text(result)), True

    def error(self, text: str) -> str:
        """A failed call's tool message: `error: <text>` on one line, within the output budget."""
        return self.cut(_one_line(f"error: {text}"))

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

    module = import_user_file(path, FLAG, "a tool file must be a .py file of functions", "posttrain_tools_",
                              ToolFileError)
    listed, environment = getattr(module, "TOOLS", None), getattr(module, "ENVIRONMENT", None)
    if environment is not None:
        if listed is not None:
            raise ToolFileError(f"{FLAG} {path}: set TOOLS (functions) or ENVIRONMENT (a class whose methods "
                                f"are the tools), not both")
        listed = _environment_tools(environment, path)
    elif listed is None:
        listed = [v for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_")
                  and v.__module__ == module.__name__]
    if not listed or not all(callable(f) for f in listed):
        raise ToolFileError(f"{FLAG} {path}: no tools: define public functions (or TOOLS = [f, ...] of "
                            f"functions, or ENVIRONMENT = a class with public methods)")
    names = [getattr(f, "__name__", repr(f)) for f in listed]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ToolFileError(f"{FLAG} {path}: TOOLS has two tools named {twice[0]!r} (a tool's name is its "
                            f"function's __name__); keep one, or rename one")
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
                    environment, _setting(module, path, "MAX_TOOL_CALLS"),
                    float(_setting(module, path, "TOOL_TIMEOUT")), _setting(module, path, "MAX_TOOL_OUTPUT"))


def _raised(path: str, environment: type, what: str, err: Exception, lead: str = "") -> ToolFileError:
    """What the ENVIRONMENT class's constructor or reset raised, as one line naming the file."""
    return ToolFileError(f"{FLAG} {path}: {lead}{environment.__name__}{what} raised {type(err).__name__}: "
                         f"{_one_line(str(err))}")


def _environment_tools(environment, path: str) -> list:
    """The public methods (but `reset`) of the ENVIRONMENT class, in the order the class defines them, bound
    to one instance built here (a constructor that raises stops the run at start-up; its schemas come from
    bound methods, without `self`). `reset` must take `prompt` and `label`; a `get_reward` (TRL's
    environment-owned reward) is refused: the run's reward source scores the episode."""
    if not inspect.isclass(environment):
        raise ToolFileError(f"{FLAG} {path}: ENVIRONMENT must be a class (one instance per episode), got "
                            f"{type(environment).__name__}")
    try:
        probe = environment()
    except Exception as e:
        raise _raised(path, environment, "()", e, "ENVIRONMENT ") from None
    if hasattr(probe, "get_reward"):
        raise ToolFileError(f"{FLAG} {path}: {environment.__name__}.get_reward: an environment gives no "
                            f"rewards here (the run's --reward.* source scores the final answer); rename it "
                            f"if it is a tool")
    if callable(getattr(probe, "reset", None)):
        try:
            inspect.signature(probe.reset).bind(prompt="", label=None)
        except TypeError as e:
            raise ToolFileError(f"{FLAG} {path}: {environment.__name__}.reset must take prompt= and label= "
                                f"(or **kwargs): {e}") from None
    kinds = (staticmethod, classmethod)
    names = dict.fromkeys(k for klass in reversed(environment.__mro__[:-1]) for k, v in vars(klass).items()
                          if (inspect.isfunction(v) or isinstance(v, kinds)) and not k.startswith("_")
                          and k != "reset")
    return [getattr(probe, k) for k in names]


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
        self.calls = self.errors = self.malformed = 0  # `calls` also numbers the call ids
        self.environment = None
        if tools.environment is not None:
            try:
                self.environment = tools.environment()
            except Exception as e:
                raise _raised(tools.path, tools.environment, "()", e) from None
        self.functions = tools.functions if self.environment is None else {
            name: getattr(self.environment, name) for name in tools.functions}

    async def reset(self, states: dict, **kwargs):
        reset = getattr(self.environment, "reset", None)
        if callable(reset):
            try:
                out = reset(prompt=states["observation"], label=states.get("label"))
                if inspect.iscoroutine(out):
                    out = await out
            except Exception as e:
                raise _raised(self.tools.path, self.tools.environment, ".reset()", e) from None
            if out is not None:
                raise ToolFileError(f"{FLAG} {self.tools.path}: {type(self.environment).__name__}.reset() "
                                    f"returned {type(out).__name__}, not None: put an initial observation in "
                                    f"the prompt dataset")
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        text, ids = states["action_text"], list(states.get("action_token_ids") or ())
        ended = states.get("finish_reason", "stop") == "stop"  # a turn cut by its token cap is final
        try:
            content, calls = self.format.parse(text, self.calls) if ended else (text, [])
            malformed = None
        except ToolCallError as err:
            content, calls, malformed = text, [], str(err)
        if (not calls and malformed is None) or self.calls + max(len(calls), 1) > self.tools.max_tool_calls:
            return self._result("", done=True)  # the final answer, or a call past the cap
        if malformed is not None:
            replies = [{"role": "tool", "tool_call_id": self.format.call_id(self.calls),
                        "content": self.tools.error(malformed)}]
            self.calls, self.errors, self.malformed = self.calls + 1, self.errors + 1, self.malformed + 1
            assistant = {"role": "assistant", "content": text}
        else:
            assistant = {"role": "assistant", "content": content,
                         "tool_calls": [{"id": c.id, "type": "function",
                                         "function": {"name": c.name, "arguments": c.arguments}}
                                        for c in calls]}
            replies = []
            for c in calls:
                out, ok = await self.tools.run(c.name, c.arguments, self.functions)
                self.calls, self.errors = self.calls + 1, self.errors + (not ok)
                replies.append({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": out})
        stop = self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ended else ""
        return self._result(self.feedback(assistant, replies, stop), done=False)

    def _result(self, feedback: str, done: bool) -> dict:
        return {"rewards": None, "scores": None, "environment_feedback": feedback, "done": done,
                "extra_logs": {"tool_calls": float(self.calls), "tool_errors": float(self.errors),
                               "tool_stuck": float(self.tools.stuck_calls),
                               "malformed_calls": self.malformed}}

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools.schemas, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def feedback(self, assistant: dict, replies: list[dict], stop_text: str) -> str:
        """The text after the model's turn (which ended with `stop_text`, the end-of-turn token it sampled):
        the rest of the template's end of an assistant turn, the tool messages and the next generation
        prompt, cut from renderings of a one-question conversation. A turn that ended on another stop token
        (an EOS that is not the template's end of turn) keeps it: it was sampled and is trained as sampled,
        so the template's whole closing follows it and the episode has that one token more than the
        template renders (a sampled token is never dropped or re-tokenised)."""
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

    FLAG = FLAG  # the flag the agent runner names in its errors

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
