"""Ctrl-C (SIGINT) and SIGTERM (`kill`, Slurm, Kubernetes) as a user-facing ending instead of a traceback
or a silent death.

    with interrupt_as_error(lambda how: f"{how} at step {loop.step}; last checkpoint: {path or 'none'}"):
        ...the training loop...

Inside the block SIGINT raises KeyboardInterrupt and SIGTERM raises `Terminate` (a KeyboardInterrupt, so
every clean-up written for Ctrl-C runs for it too: a checkpoint save removes its temp folder, `finally`
blocks shut Ray workers down). The first signal decides how the run ends: `Interrupted(describe(
"interrupted"))` for SIGINT, exit status 2; `Terminated(describe("terminated"))` for SIGTERM, exit status
143 (128 + SIGTERM, what a shell reports for a process that SIGTERM ended); also when a library turned the
KeyboardInterrupt into one of its own (Ray raises a plain KeyboardInterrupt for any signal). Both are
UserErrors: the command line prints one `prog: error: <message>` line. A second SIGINT or SIGTERM
(a second Ctrl-C, the group-wide TERM of a scheduler) is ignored, so the clean-up completes and the exit
status stays the first signal's; a third ends the process at once (`os._exit` with the first signal's
status), so a hung clean-up can be stopped without `kill -9`. `describe` is called once the block has
unwound to it, so it reports the state the clean-up left (the last checkpoint that survived).

The handlers are installed only from the main thread (where Python runs signal handlers), by the outermost
block (blocks nest: the trainers' and the step loop's); it restores the previous ones when it ends, so an
in-process caller (a sweep, a notebook) gets its own handling back. Only inside `signals_end_the_process()`
(the command line, which exits with the error) do they stay until the process exits, still counting: the
second signal ignored, the third ending the process. An ignored SIGINT (a job started in the background)
stays ignored. Clean-up of half-written files is the job of the code that writes them
(`CheckpointManager.save` removes its temp folder)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from posttrain.utils.errors import UserError

SIGTERM_EXIT = 128 + signal.SIGTERM  # 143


class Interrupted(UserError):
    """The run was stopped with Ctrl-C (SIGINT); the message says at which step and what survives."""


class Terminated(Interrupted):
    """The run was stopped with SIGTERM; the command line exits with status 143."""

    exit_code = SIGTERM_EXIT


class Terminate(KeyboardInterrupt):
    """Raised by the SIGTERM handler inside `interrupt_as_error`."""


class _State:
    installed = False  # the outermost `interrupt_as_error` block (main thread) holds the handlers
    first: int | None = None  # the first signal received inside it
    count = 0  # signals received since the first
    ends_process = False  # `signals_end_the_process()`


def _on_signal(signum, frame) -> None:
    _State.count += 1
    if _State.first is None:
        _State.first, _State.count = signum, 1
        raise Terminate() if signum == signal.SIGTERM else KeyboardInterrupt()
    if _State.count < 3:  # already stopping: let the clean-up finish
        print("[posttrain] stopping: the clean-up is running; one more Ctrl-C or SIGTERM ends the process "
              "at once, without it", file=sys.stderr, flush=True)
        return
    print(f"[posttrain] {signal.Signals(signum).name} a third time: exiting at once, the clean-up unfinished",
          file=sys.stderr, flush=True)
    os._exit(SIGTERM_EXIT if _State.first == signal.SIGTERM else 2)


@contextmanager
def signals_end_the_process() -> Iterator[None]:
    """For the command line only (the process exits at the end of the block): from the first SIGINT or
    SIGTERM on (of an `interrupt_as_error` block, or one `stopping` reports), the handlers stay until the
    process exits: a second signal is ignored, a third ends the process at once."""
    before, _State.ends_process = _State.ends_process, True
    try:
        yield
    finally:
        _State.ends_process = before


def stopping(signum: int = signal.SIGINT) -> None:
    """The process is ending because of `signum`, which arrived outside an `interrupt_as_error` block: inside
    `signals_end_the_process()` (main thread) later signals are counted as after a first one in a block;
    elsewhere a no-op (an in-process caller keeps its own handlers)."""
    if not _State.ends_process or threading.current_thread() is not threading.main_thread():
        return
    if _State.first is None:
        _State.first, _State.count = signum, 1
    for s in (signal.SIGINT, signal.SIGTERM):
        if s == signal.SIGTERM or signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _on_signal)


@contextmanager
def handlers_kept() -> Iterator[None]:
    """Re-apply Python's SIGINT and SIGTERM handlers after the block (main thread): native code may reset
    them behind Python's back (Ray's driver shutdown puts SIGTERM back to the default, which would let a
    second signal kill a run that is stopping)."""
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                handler = signal.getsignal(s)
                signal.signal(s, signal.SIG_DFL if handler is None else handler)


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT and SIGTERM go to `_on_signal` inside the outermost block (main thread; else a no-op)."""
    if threading.current_thread() is not threading.main_thread() or _State.installed:
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    _State.installed, _State.first, _State.count = True, None, 0
    try:  # a signal arriving while the handlers go in still reaches the `finally`
        for s, handler in previous.items():
            if handler is not signal.SIG_IGN or s == signal.SIGTERM:  # a SIGINT ignored by the shell stays so
                signal.signal(s, _on_signal)
        yield
    finally:
        _State.installed = False
        if _State.first is None or not _State.ends_process:  # else: counted until the process exits
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
            _State.first, _State.count = None, 0


@contextmanager
def interrupt_as_error(describe: Callable[[str], str]) -> Iterator[None]:
    with _signals_raise():
        try:
            yield
        except KeyboardInterrupt as e:
            if isinstance(e, Terminate) or _State.first == signal.SIGTERM:
                raise Terminated(describe("terminated")) from None
            raise Interrupted(describe("interrupted")) from None
