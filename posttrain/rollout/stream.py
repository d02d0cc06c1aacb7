"""Continuous batching for requests that arrive one at a time from other threads (agent episodes):
`DecodeServer(engine).submit(...)` queues a request; one decode thread admits waiting requests into the
running batch between decode steps (`DecodeBatch`), so a request starts at the next step instead of
waiting for the batch to finish, and leaves it as soon as it finishes.

A request's samples are exactly those `engine.generate` gives for its prompt and seed: every sample
draws from its own generator, and a row never attends another row's tokens (tested against the batch
call with concurrent episodes). An error in the decode loop fails every request in flight with it; the
server keeps serving new requests. A cancelled request (`Ticket.cancel`: its caller timed out) leaves
the batch at the next step, so an abandoned episode does not keep decoding (vLLM aborts the request)."""
from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack

from posttrain.rollout.sampling import check_seeds
from posttrain.rollout.types import RolloutOutput, SamplingParams, check_budgets

Callback = Callable[[list[RolloutOutput] | None, BaseException | None], None]


class Ticket:
    """One request: its `n` samples and the callback that receives them (or the error). `cancel()`
    (any thread): the caller no longer wants it; its rows leave the decode batch at the next step."""

    def __init__(self, sequences, on_done: Callback, open_tickets: set) -> None:
        self.sequences, self.on_done, self.left = sequences, on_done, len(sequences)
        self.settled = False
        self._open = open_tickets
        open_tickets.add(self)

    def finished_one(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.settle([s.output() for s in self.sequences], None)

    def settle(self, outputs, error) -> None:
        if not self.settled:
            self.settled = True
            self._open.discard(self)
            self.on_done(outputs, error)

    def cancel(self) -> None:
        if not self.settled:
            self.settled = True
            self._open.discard(self)
            for s in self.sequences:
                s.cancelled = True


class DecodeServer:
    """`engine`: an `HFRolloutEngine`; `max_rows`: the most rows decoded together (None: the engine's
    `batch_size`, else no cap)."""

    def __init__(self, engine, max_rows: int | None = None) -> None:
        self.engine = engine
        self.max_rows = max_rows or engine.batch_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._open: set[Ticket] = set()  # submitted, not yet settled or cancelled
        self.steps = 0  # decode steps taken (for tests)
        self.max_live = 0  # the most requests' rows decoded together (for tests)

    def submit(self, prompt, params: SamplingParams, seed: int | None, max_new_tokens: int | None,
               on_done: Callback) -> Ticket | None:
        """Queue `params.n` samples of `prompt` (budget `max_new_tokens`, None: `params.max_new_tokens`;
        `seed` None: drawn from torch's global RNG). `on_done(outputs, None)` or `on_done(None, error)`
        is called once, on the decode thread, unless the returned ticket is cancelled first; a malformed
        request gets its ValueError at once (and None)."""
        return self.submit_all([(prompt, params, seed, max_new_tokens, on_done)])[0]

    def submit_all(self, requests: list[tuple]) -> list[Ticket | None]:
        """Several `submit` argument tuples, queued together (they join the batch at the same step); their
        tickets."""
        sequences, tickets = [], []
        for prompt, params, seed, max_new_tokens, on_done in requests:
            try:
                mine = self._sequences(prompt, params, seed, max_new_tokens)
            except ValueError as e:  # only this request is malformed
                on_done(None, e)
                tickets.append(None)
                continue
            ticket = Ticket(mine, on_done, self._open)
            for s in mine:
                s.ticket = ticket
            sequences += mine
            tickets.append(ticket)
        if sequences:
            with self._lock:  # `_serve` exits under this lock only when the inbox is empty
                self._inbox.put(sequences)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name="posttrain-decode", daemon=True)
                    self._thread.start()
        return tickets

    def _sequences(self, prompt, params, seed, max_new_tokens):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
        prompts = self.engine._check_prompts([prompt])
        seeds = check_seeds(None if seed is None else [seed], 1)
        budgets = check_budgets(None if max_new_tokens is None else [max_new_tokens], 1, params)
        return self.engine.sequences(prompts, params, budgets, seeds)

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Stop the decode thread once the requests already submitted have finished (`cancel`: cancel them
        first, so it stops at its next step); `timeout` (seconds): wait that long for it to stop."""
        if cancel:
            for ticket in list(self._open):
                ticket.cancel()
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._inbox.put(None)
        if thread is not None and timeout is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _serve(self) -> None:
        pending: deque = deque()
        batch = self.engine.decode_batch()
        closing = False
        with ExitStack() as inference:  # eval mode and no_grad while rows are in flight
            while True:
                idle = not pending and not len(batch)
                if idle:
                    inference.close()  # the model's train/eval flags are restored while idle
                    if closing and self._exit():
                        return
                try:
                    item = self._inbox.get(block=idle)
                    while True:  # everything that has arrived joins this step's admission
                        if item is None:
                            closing = True
                        else:
                            pending.extend(item)
                        item = self._inbox.get_nowait()
                except queue.Empty:
                    pass
                if not pending and not len(batch):
                    continue
                if idle:
                    inference.enter_context(self.engine.inference())
                batch = self._step(batch, pending)

    def _exit(self) -> bool:
        """Leave the loop unless a request arrived since the close (then it is served first)."""
        with self._lock:
            if not self._inbox.empty():
                return False
            self._thread = None
            return True

    def _step(self, batch, pending: deque):
        """Admit what fits, take one decode step, settle the finished requests; the batch to go on with."""
        joining, in_flight = [], list(batch.rows)
        try:
            with self.engine.decode_step():  # a weight load (partial rollout) happens between steps
                joining = batch.admit_waiting(pending, self.max_rows or len(batch) + len(pending))
                self.max_live = max(self.max_live, len({id(s.ticket) for s in batch.rows}))
                finished = batch.step()
            self.steps += 1
        except BaseException as e:  # the engine failed: every request in flight gets the error (also
            # one whose rows finished in this step: `step` lost them with the exception)
            for s in in_flight + joining + list(pending):
                s.ticket.settle(None, e)
            pending.clear()
            if not isinstance(e, Exception):
                raise
            return self.engine.decode_batch()
        for s in finished:
            s.ticket.finished_one()
        return batch
