"""``PauseGate``: the HF engine's decode steps and the weight loads between them.

One thread holds the engine at a time: the decode loop for one step (``step()``: admit + step), or a weight
load for as long as it runs (``paused()``). A load gets the engine at the next step boundary: while one
waits, new steps of other threads wait too (a lock alone would let the loop take it back before the loader
wakes). The holder is reentrant: the thread that holds the engine (inside ``paused()`` or a step) enters
either again without waiting, so a sync that loads in ``paused()`` may generate, and a step may nest.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class PauseGate:
    """Who holds the engine: a reentrant lock with its owning thread recorded (``holder``), and the count
    of ``paused()`` callers waiting for it, which new steps of other threads let pass first. No private
    threading API: whether the caller holds it is read from ``_holder``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._holder: int | None = None  # the owning thread's id, set only by that thread, under the lock
        self._depth = 0
        self._loads = threading.Condition()
        self._loads_waiting = 0

    @contextmanager
    def _held(self) -> Iterator[None]:
        with self._lock:
            self._holder = threading.get_ident()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._holder = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No decode step of another thread runs inside: the engine at the next step boundary."""
        with self._loads:
            self._loads_waiting += 1
        try:
            with self._held():
                yield
        finally:
            with self._loads:
                self._loads_waiting -= 1
                self._loads.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The engine for one decode step, after any load waiting in ``paused()`` (the holder goes on)."""
        if self._holder != threading.get_ident():  # only this thread ever records its own id
            with self._loads:
                self._loads.wait_for(lambda: self._loads_waiting == 0)
        with self._held():
            yield
