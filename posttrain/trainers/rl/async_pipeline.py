"""Async RL (`--train.async_enable`): rollout batches are generated in a producer thread while the
trainer trains, at most `--train.async_queue_size` (the lookahead L) batches ahead.

Protocol (OpenRLHF's `ppo_trainer_async.py`, in one process with a thread instead of two Ray actors):
 * the producer may start batch j (the batch step j trains) once the trainer has completed step
   j - 1 - L (trained and synced the engines): at most L batches wait while one trains, so memory is
   bounded. With L = 1, batch j+1 is generated while step j trains, exactly when OpenRLHF's generator
   takes the slot the trainer returns on popping batch j; with L = 0 it is the synchronous loop;
 * without partial rollout the producer holds `lock` while it generates (until `produce` calls
   `generated()`, e.g. before a slow reward scores the batch, or until `produce` returns), and the
   trainer's weight sync takes it too: a batch is sampled by one policy version, and a sync never
   interleaves with generation. Before the sync that follows step s the trainer waits until batch
   s + L has started (`before_sync`), so batch j is always sampled by version max(first, j - L):
   staleness is exactly L and a seeded run is reproducible whatever the timing (OpenRLHF's version
   depends on timing for L > 1). With partial rollout the producer does not hold the lock; the sync pauses the
   engines between decode steps instead (`HFRolloutEngine.paused`, `VLLMAsyncRolloutEngine.paused`) and
   generation goes on with new weights;
 * each batch carries the policy version it started with and whatever `produce` returned (the
   trainer's prompt cursor after its draw: a checkpoint stores the cursor of the last batch trained,
   so a resumed run regenerates what was queued and neither replays nor skips a prompt).
`close()` cancels: the producer stops before its next batch, queued batches are dropped (never
trained), and the thread is joined."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Produced:
    """One rollout batch: `result` (what `produce(step)` returned), the policy version it started with and
    the producer's wall time on it."""
    step: int
    result: object
    version: int
    seconds: float


class PipelineClosed(Exception):
    pass


class RolloutPipeline:
    """`produce(step) -> result` generates the batch of `step` (on the producer thread); `version()` reads
    the current policy version. Batches `first..last-1` are produced in order."""

    def __init__(self, produce: Callable[[int], object], version: Callable[[], int], *, first: int, last: int,
                 lookahead: int, lock: threading.Lock, hold_lock: bool) -> None:
        self.produce, self.version = produce, version
        self.first, self.last, self.lookahead = first, last, lookahead
        self.lock, self.hold_lock = lock, hold_lock
        self._cond = threading.Condition()
        self._ready: deque[Produced] = deque()
        self._completed = first  # steps the trainer has completed (trained and synced)
        self._started = first - 1  # the last batch the producer started (holding the lock when it does)
        self._error: BaseException | None = None
        self._stop = self._finished = self._holding = False
        self._thread = threading.Thread(target=self._run, name="posttrain-rollout-producer", daemon=True)
        self.max_queued = 0  # the most batches waiting at once

    def start(self) -> RolloutPipeline:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for step in range(self.first, self.last):
                with self._cond:
                    self._cond.wait_for(lambda s=step: self._stop or self._completed >= s - self.lookahead)
                    if self._stop:
                        return
                if self.hold_lock:
                    self.lock.acquire()
                    self._holding = True
                try:
                    t0, version = time.perf_counter(), self._begin(step)
                    result = self.produce(step)
                finally:
                    self.generated()
                with self._cond:
                    if self._stop:  # closed while it generated: dropped
                        return
                    self._ready.append(Produced(step, result, version, time.perf_counter() - t0))
                    self.max_queued = max(self.max_queued, len(self._ready))
                    self._cond.notify_all()
        except BaseException as e:  # the trainer re-raises it on its next `get`
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def generated(self) -> None:
        """Called by `produce` (on the producer thread) once the batch's samples are all generated: the
        lock is released, so a weight sync may run while the batch is still being scored."""
        if self._holding:
            self._holding = False
            self.lock.release()

    def _begin(self, step: int) -> int:
        version = self.version()
        with self._cond:
            self._started = step
            self._cond.notify_all()
        return version

    def get(self, step: int) -> Produced:
        """The batch of `step` (blocks until it is ready); the producer's error if it failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._error is not None or self._stop
                                or self._finished)
            if self._ready:
                item = self._ready.popleft()
                if item.step != step:
                    raise RuntimeError(f"the rollout pipeline produced step {item.step}, the trainer "
                                       f"expected {step}")
                return item
            if self._error is not None:
                raise self._error
            raise PipelineClosed(f"the rollout pipeline ended before step {step}")

    def before_sync(self, step: int) -> None:
        """Before the weight sync that follows `step` (no partial rollout): wait until batch step + L has
        started with the current version (or will never start), so its version does not depend on timing."""
        if not self.hold_lock:
            return
        target = step + self.lookahead
        with self._cond:
            self._cond.wait_for(lambda: self._started >= target or target >= self.last or self._stop
                                or self._finished)

    def step_done(self, step: int) -> None:
        """The trainer completed `step` (trained, engines synced): batches up to step + 1 + L may start."""
        with self._cond:
            self._completed = step + 1
            self._cond.notify_all()

    def close(self, timeout: float = 600.0) -> int:
        """Stop producing and drop what is queued; wait up to `timeout` s for a batch in progress (a
        second Ctrl-C stops the wait); returns how many batches were dropped."""
        with self._cond:
            self._stop = True
            dropped = len(self._ready)
            self._ready.clear()
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            try:
                self._thread.join(timeout)
            except KeyboardInterrupt:
                pass
        return dropped

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


def staleness_metrics(rollouts, batch_version: int, current_version: int) -> dict[str, float]:
    """`async/staleness_mean` / `_max`: how many policy versions behind the trainer's current one each
    sample's oldest token is; `rollout/policy_versions_per_sample`: the versions that sampled a sample
    (> 1 only with partial rollout). A sample whose engine records no versions (vLLM's offline engine, a
    failed episode) counts as sampled by `batch_version`, the version its batch started with."""
    versions = [r.policy_versions or [batch_version] for r in rollouts] or [[batch_version]]
    behind = [current_version - min(v) for v in versions]
    return {"async/staleness_mean": sum(behind) / len(behind), "async/staleness_max": float(max(behind)),
            "rollout/policy_versions_per_sample": sum(map(len, versions)) / len(versions)}
