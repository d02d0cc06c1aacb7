"""``VLLMAsyncRolloutEngine``: the vLLM rollout engine over vLLM's ``AsyncLLM`` (``vllm.v1.engine.async_llm``)
instead of the offline ``LLM``, for what needs requests added, aborted or paused while others run:
async RL with partial rollout (a weight sync pauses generation mid-request) and agent episodes (each
model call a request of its own, continuous batching).

``AsyncLLM`` runs its engine core in a process of its own (also on CPU) and its output handler on an
asyncio loop: the engine owns a loop thread (``AsyncLLMHandle``) and offers the same synchronous methods as
``VLLMRolloutEngine`` (``generate``, the bucketed weight sync, ``sleep`` / ``wake_up``), which submit to it.

Partial rollout, as in OpenRLHF's async trainer: ``paused()`` pauses the scheduler (``pause_generation(
mode="keep", clear_cache=True)``): the step in flight finishes, the requests stay queued, and their KV
cache is dropped, so when ``resume_generation`` follows the weight load they are recomputed (prompt +
tokens so far) with the new weights, as the HF engine re-prefills. ``weights_updated(version)`` labels
the engine core's weights with ``str(version)`` while it is paused; vLLM stamps every step's outputs
with that label (``CompletionOutput.weight_versions``, spans of output tokens), which become the
samples' ``policy_versions``. So a sample that spans a sync records, token by token, the version that
sampled it, and each token's log-prob is that version's (a token drawn under the ``min_tokens`` ban is
scored again unbanned once its request ends, ``VLLMRolloutEngine._unban_logprobs``: by the weights current
then).

``stream()`` is the ``AsyncRolloutEngine`` front's continuous-batching interface (as the HF engine's
``stream.DecodeServer``): each request is submitted to ``AsyncLLM`` at once, joins the running batch at
the engine's next step, and a cancelled ticket aborts it in vLLM."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from types import SimpleNamespace

from posttrain.rollout.sampling import check_seeds
from posttrain.rollout.types import SamplingParams, check_budgets
from posttrain.rollout.vllm_engine import VLLMRolloutEngine
from posttrain.rollout.vllm_worker import bucket_bytes
from posttrain.utils.log import warn_once


class AsyncLLMHandle:
    """An ``AsyncLLM`` on an event loop in a thread of its own, called synchronously from any thread; the
    subset of ``vllm.LLM`` that ``VLLMRolloutEngine`` uses (``generate``, ``collective_rpc``,
    ``reset_prefix_cache``, ``sleep``, ``wake_up``, ``remove_lora``), plus pause / resume and the weight
    label. Its engine core process dies with this thread (``posttrain_die_with_parent``)."""


    def __init__(self, vllm, model: str, llm_kwargs: dict) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._ids = itertools.count()
        self._calls: set[Future] = set()  # what `submit` has running on the loop (`shutdown` cancels them)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="posttrain-vllm-async",
                                        daemon=True)
        self._thread.start()
        args = vllm.AsyncEngineArgs(model=model, **llm_kwargs)

        async def build():  # on the loop: AsyncLLM's output handler runs there
            return AsyncLLM.from_engine_args(args)
        try:
            self.llm = self.run(build())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        self.collective_rpc("posttrain_die_with_parent")
        # what `VLLMRolloutEngine` reads from `LLM.llm_engine` (the banned ids of `_unban_logprobs`, the
        # model's config); LoRAs are removed through `remove_lora` below
        self.llm_engine = SimpleNamespace(input_processor=self.llm.input_processor,
                                          model_config=self.llm.model_config)

    def run(self, coro):
        """Run ``coro`` on the loop and wait for its result."""
        return self.submit(coro).result()

    def submit(self, coro) -> Future:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)
        return future

    async def request(self, prompt: dict, sampling, lora_request=None):
        """One request's final ``RequestOutput`` (cancelling the coroutine aborts it in vLLM)."""
        from vllm.sampling_params import RequestOutputKind

        sampling.output_kind = RequestOutputKind.FINAL_ONLY
        last = None
        async for out in self.llm.generate(prompt, sampling, request_id=f"posttrain-{next(self._ids)}",
                                           lora_request=lora_request):
            last = out
        return last

    def generate(self, prompts, sampling, use_tqdm: bool = False, lora_request=None):
        """As ``vllm.LLM.generate``: one final output per prompt, in order; the requests run together and
        the others are aborted when one fails."""
        async def all_of():
            tasks = [asyncio.ensure_future(self.request(p, s, lora_request))
                     for p, s in zip(prompts, sampling)]
            try:
                return await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
        return self.run(all_of())

    def collective_rpc(self, method: str, args: tuple = ()):
        """A weight bucket crosses to the engine core process as bytes (``vllm_worker.bucket_bytes``)."""
        if method == "posttrain_reload_bucket":
            args = (bucket_bytes(args[0]),)
        return self.run(self.llm.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> None:
        self.run(self.llm.reset_prefix_cache())

    def pause(self) -> None:
        """Freeze the requests in flight (after the step under way) and drop their KV cache."""
        self.run(self.llm.pause_generation(mode="keep", clear_cache=True))

    def resume(self) -> None:
        self.run(self.llm.resume_generation())

    def set_weight_version(self, label: str) -> None:
        self.run(self.llm.update_weight_version(label))

    def sleep(self, level: int = 1) -> None:
        self.run(self.llm.sleep(level=level))

    def wake_up(self, tags=None) -> None:
        self.run(self.llm.wake_up(tags))

    def remove_lora(self, lora_id: int) -> None:
        self.run(self.llm.remove_lora(lora_id))

    def shutdown(self) -> None:
        """Stop the engine core and the loop, quietly: the requests still running are cancelled (their
        callers get ``CancelledError``, not a wait without end), then the output handler (it logged
        ``EngineDeadError`` as an ERROR when the core died under it), then ``AsyncLLM.shutdown`` runs, once:
        its ``__del__`` at interpreter exit, when vLLM's module globals are gone, printed a ``TypeError``.
        Not from the loop's own thread."""
        if self.loop.is_closed():
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncLLMHandle.shutdown() from its own event loop's thread would wait for "
                               "itself")

        running = list(self._calls)
        for call in running:
            call.cancel()
        futures_wait(running, timeout=60)

        async def stop():
            handler = getattr(self.llm, "output_handler", None)
            if handler is not None and not handler.done():
                handler.cancel()
                with contextlib.suppress(BaseException):
                    await handler
            self.llm.shutdown()
        try:
            self.run(stop())
        except Exception as e:  # the engine core dies with this process anyway (`posttrain_die_with_parent`)
            warn_once(f"vLLM's AsyncLLM did not shut down cleanly: {type(e).__name__}: {e}")
        self.llm.shutdown = lambda *args, **kwargs: None  # shut down once: __del__ calls it again
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


class VLLMAsyncRolloutEngine(VLLMRolloutEngine):
    """``VLLMRolloutEngine`` (same arguments, a model folder) over ``AsyncLLM`` (module docstring):
    ``paused()`` for a weight sync while samples are in flight, per-token ``policy_versions``, and
    ``stream()`` for the async front."""

    def __init__(self, model_path, eos_token_ids=None, **kwargs) -> None:
        if not isinstance(model_path, (str, os.PathLike)):
            raise TypeError("VLLMAsyncRolloutEngine builds its own AsyncLLM: pass a model folder")
        self._pause = threading.RLock()
        super().__init__(model_path, eos_token_ids, **kwargs)

    def _make_llm(self, vllm, model: str, llm_kwargs: dict) -> AsyncLLMHandle:
        return AsyncLLMHandle(vllm, model, llm_kwargs)

    @contextlib.contextmanager
    def paused(self):
        """No step runs inside (the one under way finishes first); the requests in flight continue after
        it, recomputed with the weights loaded meanwhile. Held by a weight sync (`EngineWorker.sync_receive`,
        `Actor.broadcast_weights`), with ``weights_updated(version)`` inside."""
        with self._pause:
            self.llm.pause()
            try:
                yield
            finally:
                self.llm.resume()

    def weights_updated(self, version: int | None = None) -> None:
        """Ends a sync (``VLLMRolloutEngine.weights_updated``); ``version`` labels the tokens sampled from
        now on (None: unchanged). Call it inside ``paused()`` when requests are in flight."""
        super().weights_updated(version)
        if version is not None:
            self.llm.set_weight_version(str(int(version)))

    def stream(self, max_rows: int | None = None) -> RequestStream:
        """The async front's continuous batching (vLLM's scheduler sizes its batches: ``max_rows`` unused)."""
        return RequestStream(self)

    def close(self) -> None:
        """Stop the engine core process and the loop thread."""
        self.llm.shutdown()


class RequestStream:
    """``submit_all`` as ``stream.DecodeServer``'s: each ``(prompt, params, seed, max_new_tokens, on_done)``
    becomes one vLLM request; ``on_done(outputs, None)`` / ``on_done(None, error)`` is called once (on a
    thread of the stream) unless its ticket (a ``concurrent.futures.Future``) is cancelled first, which aborts
    the request; a malformed request gets its ValueError at once (and None)."""

    def __init__(self, engine: VLLMAsyncRolloutEngine) -> None:
        self.engine = engine
        self._open: set[Future] = set()
        # finishing an output may score tokens again (`finish_outputs`): a call into the loop, so not on it
        self._finish = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-vllm-finish")

    def submit_all(self, requests: list[tuple]) -> list[Future | None]:
        return [self._submit(*r) for r in requests]

    def _submit(self, prompt, params, seed, max_new_tokens, on_done) -> Future | None:
        engine = self.engine
        try:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
            ids = [int(t) for t in prompt]
            seeds = check_seeds(None if seed is None else [seed], 1)
            budget = check_budgets(None if max_new_tokens is None else [max_new_tokens], 1, params)[0]
        except ValueError as e:
            on_done(None, e)
            return None
        sampling = engine.vllm_sampling_params(params, 0, budget, None if seeds is None else seeds[0])
        request, lora = {"prompt_token_ids": ids}, engine.lora_request
        ticket = engine.llm.submit(engine.llm.request(request, sampling, lora))
        self._open.add(ticket)

        def finish(f: Future) -> None:
            try:
                extra = {} if lora is None else {"lora_request": lora}
                outputs = engine.finish_outputs([ids], [request], [sampling], [f.result()], params, extra)[0]
            except BaseException as e:  # the engine's error, or outputs that break the contract
                on_done(None, e)
            else:
                on_done(outputs, None)

        def done(f: Future) -> None:
            self._open.discard(f)
            if not f.cancelled():
                try:
                    self._finish.submit(finish, f)
                except RuntimeError as e:  # the stream was closed meanwhile
                    on_done(None, e)
        ticket.add_done_callback(done)
        return ticket

    def close(self, cancel: bool = False, timeout: float | None = None) -> None:
        """`cancel`: abort the requests still in flight."""
        if cancel:
            for ticket in list(self._open):
                ticket.cancel()
        self._finish.shutdown(wait=False)
