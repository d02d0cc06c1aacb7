"""An asyncio front over a rollout engine: many concurrent callers (agent episodes) each
`await generate(token_ids, params, seed=..., max_new_tokens=...)` one request at a time.

Scheduling: when a request arrives the front yields to the event loop until no new request comes (so
the episodes that are ready to ask do so), then hands every waiting request to the engine together.
 * An engine with `stream()` (the HF engine) does continuous batching: the requests join its running
   decode batch at the next decode step and leave it when they finish, each with its own KV cache
   rows (`stream.DecodeServer`); a malformed request fails alone.
 * Any other engine (vLLM, a Ray engine group, test fakes) gets one batched `engine.generate` call per
   group of waiting requests with the same sampling settings (temperature, top-p, stop ids), run in
   the front's own thread; requests that arrive meanwhile form the next call (dynamic batching).

Exactness: each request carries its own seed (`generate`: one sample; `generate_n`: a prompt's `n`
samples, as the batch engine draws them), and the engine samples every row from a generator of its
own, so a request's tokens and log-probs do not depend on which other requests share its batch:
concurrent and sequential execution give the same samples (tested). A request without a seed whose
params carry one (`params.seed`) is the k-th such request of this front and gets the seed
`engine.generate` gives prompt k of one call. A caller that gives up (timeout, cancelled task) cancels
its request on a streaming engine; `close()` cancels what is left and joins the decode thread."""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from posttrain.rollout.types import RolloutOutput, SamplingParams, rank_seed


@dataclass
class _Request:
    token_ids: list[int]
    seed: int | None
    max_new_tokens: int | None  # None: the request's params.max_new_tokens
    future: asyncio.Future = field(repr=False)
    default_budget: int = 0


def _batch_key(params: SamplingParams, seeded: bool) -> tuple:
    stop = None if params.stop_token_ids is None else tuple(params.stop_token_ids)
    return (float(params.temperature), float(params.top_p), stop, int(params.min_tokens), int(params.n),
            seeded)


class AsyncRolloutEngine:
    """`engine`: anything with `generate(prompts, params, max_new_tokens=[...], seeds=[...])` (the HF
    engine, the vLLM engine, or a Ray engine group), streamed when it has `stream()`. `max_batch`: the
    most requests per engine call, or rows per decode batch when streamed (None: no cap)."""

    def __init__(self, engine, max_batch: int | None = None) -> None:
        self.engine = engine
        self.max_batch = max_batch
        # a vision-language HF engine decodes in static batches (`vision_decode`): no streaming
        self.stream = (engine.stream(max_batch) if hasattr(engine, "stream")
                       and not getattr(engine, "vision", False) \
             else None)
        self._waiting: dict[tuple, tuple[SamplingParams, list[_Request]]] = {}
        self._runner: asyncio.Task | None = None
        # the engine runs in a thread of its own: agents that block the loop's default pool (e.g. HTTP
        # calls in `asyncio.to_thread`) cannot starve it
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-rollout")
        self.batches = 0  # batched engine calls made (for tests and metrics)
        self.gather_wait = 0.0  # seconds per `_gather` yield (agent episodes on their own threads: > 0)
        self._unseeded = 0  # requests so far without a seed of their own whose params carry one

    async def generate(self, token_ids: list[int], params: SamplingParams, *, seed: int,
                       max_new_tokens: int, images=None) -> RolloutOutput:
        """One sample of `token_ids` with `params` (its `n` and `max_new_tokens` are ignored), seeded
        with `seed`, at most `max_new_tokens` tokens. `images` (a vision-language model: the prompt's
        `engine.generate` images entry): the request is an engine call of its own, in the front's thread
        (rows with images do not join a text decode batch)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if images is not None:
            call = functools.partial(self.engine.generate, [[int(t) for t in token_ids]],
                                     replace(params, n=1), max_new_tokens=[int(max_new_tokens)],
                                     seeds=[int(seed)], images=[images])
            outputs = await asyncio.get_running_loop().run_in_executor(self._thread, call)
            check_outputs(self.engine, outputs, 1, 1)
            return outputs[0][0]
        return (await self.generate_n(token_ids, replace(params, n=1), seed=seed,
                                      max_new_tokens=max_new_tokens))[0]

    async def generate_n(self, token_ids: list[int], params: SamplingParams, *, seed: int | None = None,
                         max_new_tokens: int | None = None) -> list[RolloutOutput]:
        """`params.n` samples of `token_ids`, as the batch engine's `generate` gives them for one prompt
        (`seed` None: the engine draws; `max_new_tokens` None: `params.max_new_tokens`)."""
        loop = asyncio.get_running_loop()
        if seed is None and params.seed is not None:  # the k-th such request: seeded as `engine.generate`
            seed = rank_seed(params.seed, 0, self._unseeded)  # seeds prompt k of one call
            self._unseeded += 1
        budget = int(max_new_tokens) if max_new_tokens is not None else None
        request = _Request([int(t) for t in token_ids], None if seed is None else int(seed),
                           budget, loop.create_future(), default_budget=int(params.max_new_tokens))
        key = _batch_key(params, seed is not None)
        self._waiting.setdefault(key, (params, []))[1].append(request)
        if self._runner is None or self._runner.done():
            self._runner = loop.create_task(self._run())
        return await request.future

    def close(self, timeout: float = 60.0) -> None:
        """Release the engine thread; requests still in flight are cancelled and the decode thread joined
        (`timeout` seconds at most), so nothing keeps decoding on the model after the caller returns."""
        self._thread.shutdown(wait=False)
        if self.stream is not None:
            self.stream.close(cancel=True, timeout=timeout)

    def _num_waiting(self) -> int:
        return sum(len(requests) for _, requests in self._waiting.values())

    async def _gather(self, rounds: int = 8) -> None:
        """Yield to the event loop until no new request arrives (at most `rounds` times), so every
        episode that is ready to ask joins this batch. Each yield lasts `gather_wait` seconds (0: one
        pass of the loop), which callers on other threads set so their requests can cross over."""
        seen = -1
        for _ in range(rounds):
            if self._num_waiting() == seen:
                return
            seen = self._num_waiting()
            await asyncio.sleep(self.gather_wait)

    async def _run(self) -> None:
        await self._gather()
        if self.stream is not None:
            self._submit_to_stream()
            return
        while self._waiting:
            key = next(iter(self._waiting))
            params, requests = self._waiting[key]
            batch = requests[: self.max_batch] if self.max_batch else list(requests)
            rest = requests[len(batch):]
            if rest:
                self._waiting[key] = (params, rest)
            else:
                del self._waiting[key]
            kwargs = {}
            if any(r.max_new_tokens is not None for r in batch):
                kwargs["max_new_tokens"] = [r.max_new_tokens or r.default_budget for r in batch]
            if batch[0].seed is not None:  # a batch is all seeded or all unseeded (`_batch_key`)
                kwargs["seeds"] = [r.seed for r in batch]
            call = functools.partial(self.engine.generate, [r.token_ids for r in batch], params, **kwargs)
            try:
                outputs = await asyncio.get_running_loop().run_in_executor(self._thread, call)
            except BaseException as e:  # every caller of this batch sees the engine's error
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                if not isinstance(e, Exception):
                    raise
                continue
            self.batches += 1
            try:
                check_outputs(self.engine, outputs, len(batch), params.n)
            except RuntimeError as error:
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(error)
                continue
            for r, outs in zip(batch, outputs):
                if not r.future.done():
                    r.future.set_result(outs)
            await self._gather()  # requests submitted in reaction to these results join the next batch


    def _submit_to_stream(self) -> None:
        loop = asyncio.get_running_loop()
        requests, futures = [], []
        for params, waiting in self._waiting.values():
            for r in waiting:
                requests.append((r.token_ids, params, r.seed, r.max_new_tokens,
                                 functools.partial(_settle_from_thread, loop, r.future)))
                futures.append(r.future)
        self._waiting.clear()
        self.batches += 1
        for future, ticket in zip(futures, self.stream.submit_all(requests)):
            if ticket is not None:  # a caller that gives up (timeout, cancelled task) cancels its rows
                future.add_done_callback(lambda f, t=ticket: f.cancelled() and t.cancel())


def _settle(future: asyncio.Future, outputs, error) -> None:
    if not future.done():  # a caller that timed out has cancelled it
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(outputs)


def _settle_from_thread(loop, future: asyncio.Future, outputs, error) -> None:
    try:
        loop.call_soon_threadsafe(_settle, future, outputs, error)
    except RuntimeError:  # the caller's event loop has closed: nobody waits for this result
        pass


def run_coroutine(coro):
    """`asyncio.run(coro)`, also from a thread whose event loop is already running (a notebook): then
    in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def generate_all(engine, prompt_token_ids, params: SamplingParams, max_new_tokens=None, seeds=None,
                 images=None):
    """The samples the front gives these requests when they all wait together: one batch
    `engine.generate` call (a per-prompt budget None: `params.max_new_tokens`), checked against its
    contract (a list of `params.n` outputs per prompt). Made in the caller's thread, not through an
    `AsyncRolloutEngine`, which would decode in a thread of its own: on CPU that thread's OpenMP pool
    shares the cores with the pool of the thread that trains, and a decode loop there ran about 1.4x
    slower (2 cores, `small` preset, 128 rows). By the front's exactness contract the samples are the
    same either way (tested)."""
    prompts = [[int(t) for t in ids] for ids in prompt_token_ids]
    kwargs = {}
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = [params.max_new_tokens if b is None else int(b) for b in max_new_tokens]
    if seeds is not None:
        kwargs["seeds"] = list(seeds)
    if images is not None:  # a vision-language model: each prompt's image entry (engine.generate's `images`)
        kwargs["images"] = list(images)
    outputs = engine.generate(prompts, params, **kwargs)
    check_outputs(engine, outputs, len(prompts), params.n)
    return list(outputs)


def check_outputs(engine, outputs, prompts: int, n: int) -> None:
    """RuntimeError unless `outputs` holds `n` outputs for each of `prompts` prompts."""
    if len(outputs) != prompts or any(len(outs) != n for outs in outputs):
        raise RuntimeError(f"the rollout engine returned {len(outputs)} results for {prompts} prompts "
                           f"(n={n} each): {type(engine).__name__}.generate breaks its contract")
