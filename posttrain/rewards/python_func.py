"""A reward function in a Python file (`--reward.remote_url path/to/reward.py`), OpenRLHF-compatible.

The file defines `reward_func(queries, prompts, labels, **kwargs)`: queries are the B prompt+response
texts, prompts the B prompt texts, labels the B ground-truth labels (the dataset's `--data.label_key`
field). It returns `{"rewards": B numbers, "scores": B numbers (optional, default rewards),
"extra_logs": {name: number or B numbers} (optional)}` — numbers as a torch tensor, numpy array,
list or tuple — or just the B rewards as a bare sequence. It is called once per rollout batch.

A file written for OpenRLHF may `from openrlhf.utils import extract_boxed_answer, grade_answer`:
without OpenRLHF installed those names come from posttrain (posttrain.compat.openrlhf_modules).

Each call runs in a daemon worker thread under `timeout` seconds (`--reward.timeout`); a call that
raises or runs past the timeout is a failed attempt, retried up to `retries` attempts in total
(`--reward.retries`), waiting backoff * 2**(attempt-2) s before attempt 2, 3, ... A call past the
timeout is abandoned: posttrain raises an exception in its thread to stop it, which takes effect at
the thread's next Python instruction (a call blocked inside C code, e.g. `time.sleep`, ends only when
that C call returns; the thread never blocks interpreter exit). Such a thread is a stuck call: its batch
fails at once, not retried (a retry would strand one more thread), and while max_stuck (MAX_STUCK) of them
still run, no new call starts and each batch fails at once with a RewardBusy error, even with
on_error="skip" (threads cannot be killed, so their number, not the time, is bounded). Errors caused by
the file — a syntax error, an import that raises, reward_func raising, running too long, or returning a
bad value — are RewardErrors naming the file and the cause, with the traceback lines of the user's code
(frames of posttrain itself and of the import machinery are left out).

`--reward.func_path FILE.py:NAME` names another function of the file. A function with a `completions`
parameter is called TRL's way instead, every argument by keyword: `prompts`, `completions` (the
response texts), `completion_ids`, the prompt rows' other columns (the label column too, under its own
name), and `queries` / `labels` as above; it gets the keywords it names (all of them with `**kwargs`).
For a chat prompt (a message-list row under `--data.apply_chat_template`) `prompts` holds its messages
and `completions` `[{"role": "assistant", "content": text}]`, as TRL's GRPOTrainer passes them.
An OpenRLHF-style function gets the same keywords (text prompts and completions) beside its three
positional arguments when it names them or takes `**kwargs`.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import threading
import time
import traceback

import posttrain
from posttrain.compat.user_files import UserFileExit, call_user, exec_user_file
from posttrain.config.serving import DEFAULT_MAX_STUCK as MAX_STUCK
from posttrain.rewards.math_grading import grade_answer
from posttrain.rewards.result import (
    ON_ERROR,
    RewardError,
    RewardResult,
    check_batch,
    parse_output,
    skipped_batch,
)
from posttrain.utils.extras import require
from posttrain.utils.log import warn_once

FLAG = "--reward.remote_url"
DEFAULT_TIMEOUT = 300.0  # seconds per reward_func call on a rollout batch
STOP_GRACE = 1.0  # seconds a timed-out call has to end once stopped before it counts as stuck
_POSTTRAIN_DIR = os.path.dirname(os.path.abspath(posttrain.__file__)) + os.sep
_THREADING_FILE = os.path.abspath(threading.__file__)
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.util.__file__)) + os.sep
_MAX_FRAMES = 10


def _is_user_frame(filename: str) -> bool:
    """Frames of the user's code (their file, its helpers, libraries they call), not posttrain's, the
    import machinery's or the worker thread's."""
    if filename.startswith("<frozen"):
        return False
    path = os.path.abspath(filename)
    return not path.startswith((_POSTTRAIN_DIR, _IMPORTLIB_DIR)) and path != _THREADING_FILE


def _user_frames(frames) -> list:
    return [f for f in frames if _is_user_frame(f.filename)]


def _format_frames(frames, title: str) -> str:
    """'\\n<title>:' + traceback lines (file, line, code) of `frames`; '' when there are none."""
    if not frames:
        return ""
    if len(frames) > _MAX_FRAMES:  # the outermost 3 (the user's calls) and the innermost ones
        head, tail = frames[:3], frames[3 - _MAX_FRAMES:]
        omitted = f"  ... {len(frames) - _MAX_FRAMES} frames left out ...\n"
        text = "".join(traceback.format_list(head)) + omitted + "".join(traceback.format_list(tail))
    else:
        text = "".join(traceback.format_list(frames))
    return f"\n{title}:\n{text.rstrip()}"


def _at(frames, folder: str) -> str:
    """' (at file:line)' of the innermost frame in the user's folder (else the innermost frame)."""
    own = [f for f in frames if os.path.abspath(f.filename).startswith(folder + os.sep)] or frames
    return f" (at {own[-1].filename}:{own[-1].lineno})" if own else ""


def _describe(err: BaseException, path: str) -> tuple[str, str]:
    """(one-line cause with the innermost frame of the user's code, traceback lines of the frames
    outside posttrain) for an exception raised while loading or calling the file `path`."""
    frames = _user_frames(traceback.extract_tb(err.__traceback__))
    # it names it
    at = "" if isinstance(err, UserFileExit) else _at(frames, os.path.dirname(os.path.abspath(path)))
    line = f"{type(err).__name__}: {err}{at}"
    details = _format_frames(frames, "Traceback (user code, most recent call last)")
    if isinstance(err, SyntaxError):
        details += "\n" + "".join(traceback.format_exception_only(type(err), err)).rstrip()
    return line, details


def _load_function(path: str, name: str = "reward_func"):
    if not path.endswith(".py"):
        raise ValueError(f"{FLAG}={path!r}: a reward function file must end in .py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{FLAG}={path!r}: reward function file not found "
                                f"(resolved to {os.path.abspath(path)})")
    try:
        module = exec_user_file(path, "posttrain_reward_func_")
    except SyntaxError as err:
        where = f"{err.filename}:{err.lineno}"
        _, details = _describe(err, path)
        same = os.path.abspath(err.filename or "") == os.path.abspath(path)
        what = (f"reward function file {path} has a syntax error" if same
                else f"importing reward function file {path}: {err.filename} has a syntax error")
        raise RewardError(f"{what}: {err.msg} (at {where}){details}") from err
    except Exception as err:
        line, details = _describe(err, path)
        raise RewardError(f"importing reward function file {path} raised {line}{details}") from err
    if any(v is grade_answer for v in vars(module).values()):  # the math grader: say now if it cannot run
        require(f"reward function file {path} (it imports grade_answer)", "math_verify")
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"reward function file {path} defines no `{name}` (it defines: "
                          f"{', '.join(defined) or 'nothing callable'}); add "
                          f"`def {name}(queries, prompts, labels, **kwargs)`")
    if not callable(fn):
        raise RewardError(f"reward function file {path}: `{name}` is a {type(fn).__name__}, not a "
                          f"function")
    if _trl_style(fn):
        return fn
    try:
        inspect.signature(fn).bind_partial([], [], [])  # named columns come by keyword
    except TypeError as err:
        raise RewardError(f"reward function file {path}: {name}{inspect.signature(fn)} cannot be called "
                          f"as {name}(queries, prompts, labels) ({err}); or name a `completions` parameter "
                          "to be called TRL's way, by keyword") from None
    except ValueError:  # builtins without a signature
        pass
    return fn


def _trl_style(fn) -> bool:
    """A function with a `completions` parameter takes TRL's keyword arguments (module docstring)."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except ValueError:
        return False


class _Abandoned(BaseException):
    """Raised inside a reward_func thread that ran past the timeout, to stop it (a BaseException, so
    the user's `except Exception` does not swallow it)."""


class RewardBusy(RewardError):
    """No call was started: MAX_STUCK earlier calls still run past the timeout."""


class _TimedOut(Exception):
    def __init__(self, frames, stuck: bool):
        super().__init__("timed out")
        self.frames, self.stuck = frames, stuck


def _stop(thread: threading.Thread) -> None:
    """Best effort: raise _Abandoned in `thread` at its next Python instruction (CPython only)."""
    try:
        import ctypes

        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
        ident = ctypes.c_ulong(thread.ident)
        if set_async_exc(ident, ctypes.py_object(_Abandoned)) > 1:  # never: ident is unique
            set_async_exc(ident, None)
    except (ImportError, AttributeError):
        pass


def _stuck_frames(thread: threading.Thread) -> list:
    frame = sys._current_frames().get(thread.ident)
    return _user_frames(traceback.extract_stack(frame)) if frame is not None else []


class PythonRewardFunction:
    """RewardSource calling `reward_func` from a Python file, once per batch.

    timeout: seconds one call may run (None: no limit, the call runs in the caller's thread);
    retries: attempts per batch in total (>= 1); backoff: seconds before the 2nd attempt, doubling
    after. A call that raises or times out is a failed attempt and is retried; an invalid return value
    is not (the function answered), nor a timed-out call still running STOP_GRACE s after it was stopped
    (blocked in C code: it fails the batch at once). on_error: "raise" (default) → when every attempt
    failed, or the return value is invalid, raise RewardError naming the file and the problem (for a
    timeout: the timeout, `--reward.timeout` and where the call was stuck). "skip" → the affected samples
    (all of the batch when the function failed or returned the wrong shape; single samples for non-finite
    values) are marked `skipped` with reward 0, counted in `num_skipped` and reported with a warning.
    `labels=None` is passed as B `None`s. kwargs reach the function when it accepts them (by name, or
    all with `**kwargs`). max_stuck: timed-out calls still running (`stuck_calls`) at which no call
    starts any more: every attempt then fails at once with RewardBusy (not retried, raised even with
    on_error "skip": no sample was scored or skipped)."""

    def __init__(self, path, on_error: str = "raise", *, timeout: float | None = DEFAULT_TIMEOUT,
                 retries: int = 3, backoff: float = 0.5, max_stuck: int = MAX_STUCK,
                 function: str = "reward_func"):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: valid values are {list(ON_ERROR)}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"--reward.timeout={timeout}: must be > 0 seconds")
        if retries < 1:
            raise ValueError(f"--reward.retries={retries}: must be >= 1 (attempts in total)")
        if backoff < 0:
            raise ValueError(f"backoff={backoff}: must be >= 0")
        if max_stuck < 1:
            raise ValueError(f"max_stuck={max_stuck}: must be >= 1")
        self.path = os.fspath(path)
        self.on_error = on_error
        self.timeout, self.retries, self.backoff, self.max_stuck = timeout, retries, backoff, max_stuck
        self._stuck: list[threading.Thread] = []  # abandoned workers, pruned when they end
        self._stuck_lock = threading.Lock()
        self.function = function
        self.takes_columns = True  # `rollout.single_turn.reward_kwargs`
        self.fn = _load_function(self.path, function)
        self.trl_style = _trl_style(self.fn)
        self._params = _accepted_kwargs(self.fn, 0 if self.trl_style else 3)
        code = getattr(self.fn, "__code__", None)
        self._defined_at = f"{code.co_filename}:{code.co_firstlineno}" if code else self.path
        self.origin = f"reward function {self.path}" + ("" if function == "reward_func" else f":{function}")
        self.num_calls = 0
        self.num_samples = 0
        self.num_skipped = 0
        self.num_timeouts = 0

    @property
    def stuck_calls(self) -> int:
        """Timed-out calls whose thread still runs."""
        with self._stuck_lock:
            self._stuck = [t for t in self._stuck if t.is_alive()]
            return len(self._stuck)

    def _attempt(self, args: tuple, kwargs: dict):
        if self.timeout is None:
            return call_user(self.fn, *args, **kwargs)
        stuck = self.stuck_calls
        if stuck >= self.max_stuck:
            raise RewardBusy(f"{self.origin}: {stuck} timed-out reward_func call(s) still running past the "
                             f"{self.timeout:g}s --reward.timeout (a thread cannot be killed), so no new "
                             f"call is started; fix the hang in reward_func and restart")
        box = {}
        done = threading.Event()

        def work():
            try:
                try:
                    box["value"] = call_user(self.fn, *args, **kwargs)
                except BaseException as err:  # handed to the caller (or dropped once abandoned)
                    box["error"] = err
                finally:
                    done.set()
            except _Abandoned:  # arrived after the call had finished
                pass

        worker = threading.Thread(target=work, name=f"reward_func {os.path.basename(self.path)}", daemon=True)
        worker.start()
        if not done.wait(self.timeout):
            frames = _stuck_frames(worker)
            _stop(worker)
            worker.join(STOP_GRACE)  # a call in Python code ends here; one blocked in C code is stuck
            stuck = worker.is_alive()
            if stuck:
                with self._stuck_lock:
                    self._stuck.append(worker)
            self.num_timeouts += 1
            raise _TimedOut(frames, stuck)
        if "error" in box:
            raise box.pop("error")
        return box["value"]

    def _call(self, args: tuple, kwargs: dict):
        """reward_func(*args, **kwargs) with timeout and retries; raises RewardError (message) when every
        attempt failed."""
        timeouts = 0
        for attempt in range(1, self.retries + 1):
            if attempt > 1 and self.backoff:
                time.sleep(self.backoff * 2 ** (attempt - 2))
            try:
                return self._attempt(args, kwargs)
            except _TimedOut as err:
                timeouts += 1
                last = err
                if err.stuck:  # blocked in C code: a retry would only strand one more thread
                    break
            except UserFileExit as err:  # sys.exit() is no transient failure: not retried
                last = err
                break
            except RewardBusy:
                raise
            except Exception as err:
                last = err
        tries = f" ({attempt} attempts, --reward.retries)" if attempt > 1 else ""
        if isinstance(last, _TimedOut):
            where = _format_frames(last.frames, "It was at (user code, most recent call last)")
            stuck = (" and is still running (blocked outside Python code, so not retried)"
                     if last.stuck else "")
            raise RewardError(f"{self.origin}: reward_func did not return within {self.timeout:g}s "
                              f"(--reward.timeout){stuck}{tries}; make it faster or raise --reward.timeout"
                              f"{where}")
        line, details = _describe(last, self.path)
        if timeouts:
            tries += f"; {timeouts} of them timed out after {self.timeout:g}s (--reward.timeout)"
        raise RewardError(f"{self.origin} raised {line}{tries}{details}") from last

    def score(self, queries, prompts, labels=None, **kwargs) -> RewardResult:
        n = check_batch(queries, prompts, labels)
        raw = self.call(queries, prompts, labels, **kwargs)
        return self.counted(raw if isinstance(raw, RewardResult) else self.parse(raw, n), n)

    def call(self, queries, prompts, labels=None, **kwargs):
        """The function's raw return value for the batch (timeout, retries), or, when every attempt failed
        under on_error "skip", the whole batch skipped (a RewardResult). OpenRLHF's way it is called as
        fn(queries, prompts, labels, **kwargs); TRL's way (`trl_style`: it names a `completions`
        parameter) all by keyword: prompts=, completions=, completion_ids=, queries=, labels= and the
        columns; a sample whose kwargs `prompt_messages` entry holds chat messages gets those as its prompt
        and `[{"role": "assistant", "content": text}]` as its completion (`_conversational`, as TRL passes
        a conversational prompt's). Either way only the keywords it accepts (all with `**kwargs`;
        `prompt_messages` itself is never passed); labels None: B Nones."""
        n = check_batch(queries, prompts, labels)
        labels = [None] * n if labels is None else list(labels)
        args = (list(queries), list(prompts), labels)
        messages = kwargs.pop("prompt_messages", None)
        if self.trl_style:
            kwargs = {"prompts": args[1], "queries": args[0], "labels": labels, **kwargs,
                      **(_conversational(messages, args[1], kwargs.get("completions")) if messages else {})}
            args = ()
        extra = kwargs if self._params is None else {k: v for k, v in kwargs.items() if k in self._params}
        self.num_calls += 1
        self.num_samples += n
        try:
            return self._call(args, extra)
        except RewardError as err:
            if self.on_error == "raise" or isinstance(err, RewardBusy):  # busy: nothing was scored
                raise
            return skipped_batch(n, str(err).split("\n", 1)[0])

    def parse(self, raw, n: int, origin: str | None = None) -> RewardResult:
        """`parse_output` of a raw return value under this source's on_error; an error names `origin`
        (default: the file) and where the function is defined."""
        try:
            return parse_output(raw, n, origin or self.origin, self.on_error)
        except RewardError as err:
            raise RewardError(f"{err}\n{self.function} is defined at {self._defined_at}") from None

    def counted(self, result: RewardResult, n: int) -> RewardResult:
        """`result`, its skipped samples counted and warned about."""
        if result.num_skipped:
            self.num_skipped += result.num_skipped
            warn_once(f"skipped {result.num_skipped}/{n} samples (on_error=skip): {result.skip_reasons[0]}")
        return result

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return (f"PythonRewardFunction({self.path!r}, on_error={self.on_error!r}, timeout={self.timeout}, "
                f"retries={self.retries})")


def _conversational(messages: list, prompts: list, completions: list | None) -> dict:
    """TRL's `prompts` and `completions` where a sample's prompt is chat messages (`messages[i]` not None):
    those messages, and its completion text as one assistant message in a list; text elsewhere."""
    out = {"prompts": [p if m is None else m for m, p in zip(messages, prompts)]}
    if completions is not None:
        out["completions"] = [c if m is None else [{"role": "assistant", "content": c}]
                              for m, c in zip(messages, completions)]
    return out


def _accepted_kwargs(fn, skip: int = 3) -> set[str] | None:
    """Keyword names `fn` accepts beyond its first `skip` parameters ((queries, prompts, labels)); None when
    it takes **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except ValueError:
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[skip:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
