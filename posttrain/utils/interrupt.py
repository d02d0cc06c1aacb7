"""Ctrl-C (SIGINT) and SIGTERM (`kill`, Slurm, Kubernetes) as a user-facing ending instead of a traceback
or a silent death.

    with interrupt_as_error(lambda how: f"{how} at step {loop.step}; last checkpoint: {path or 'none'}"):
        ...the training loop...

Inside the block SIGTERM raises `Terminate` (a KeyboardInterrupt, so every clean-up written for Ctrl-C
runs for it too: a checkpoint save removes its temp folder, `finally` blocks shut Ray workers down).
A KeyboardInterrupt raised inside the block becomes `Interrupted(describe("interrupted"))`, exit status
2; a `Terminate` becomes `Terminated(describe("terminated"))`, exit status 143 (128 + SIGTERM, what a
shell reports for a process that SIGTERM ended). Both are UserErrors: the command line prints one
`prog: error: <message>` line. `describe` is called when the signal arrives, so it reports the state
at that moment. The SIGTERM handler is installed only from the main thread (where Python runs signal
handlers) and the previous one is restored when the block ends. Clean-up of half-written files is the
job of the code that writes them (`CheckpointManager.save` removes its temp folder)."""
from __future__ import annotations

import signal
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


def _on_sigterm(signum, frame) -> None:
    raise Terminate()


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block SIGTERM raises `Terminate` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextmanager
def interrupt_as_error(describe: Callable[[str], str]) -> Iterator[None]:
    try:
        with sigterm_raises():
            yield
    except Terminate:
        raise Terminated(describe("terminated")) from None
    except KeyboardInterrupt:
        raise Interrupted(describe("interrupted")) from None
