"""Ctrl-C (SIGINT) as a user-facing ending instead of a traceback.

    with interrupt_as_error(lambda: f"interrupted at step {loop.step}; last checkpoint: {path or 'none'}"):
        ...the training loop...

A KeyboardInterrupt raised inside the block becomes `Interrupted(describe())`, a UserError, so the
command line prints one `prog: error: <message>` line and exits with status 2. `describe` is called
when the interrupt arrives, so it reports the state at that moment. Clean-up of half-written files
is the job of the code that writes them (`CheckpointManager.save` removes its temp folder)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from posttrain.utils.errors import UserError


class Interrupted(UserError):
    """The run was stopped with Ctrl-C (SIGINT); the message says at which step and what survives."""


@contextmanager
def interrupt_as_error(describe: Callable[[], str]) -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(describe()) from None
