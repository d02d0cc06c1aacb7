"""Rollout throughput through the async front (`rollout/async_engine.py`) against the batch
engine it wraps, on the same model and prompts.

    .venv/bin/python bench/rollout_async.py [--size tiny] [--batches 16 64] [--max-new-tokens
    32] [--repeats 5]

Table 1, one batch of B prompts (temperature 1, per-prompt seeds, the same budgets):
  - `engine.generate`: the single batch call (the reference);
  - `generate_all`: `SingleTurnSampler`'s path, every request submitted to the front at once;
  - `B episodes`: B coroutines each awaiting `front.generate` for one prompt, as agent episodes do
    (each request carries its own seed, so the samples equal the batch call's seeds per prompt).
Table 2, B agent-like episodes of `--turns` requests each, every request with its own budget drawn
from 1..max_new_tokens (and no stop token, so budgets decide): the HF engine's continuous batching
(requests join the running decode batch) against batch-boundary scheduling (the same front over the
same engine without `stream()`: one `engine.generate` call per group of waiting requests).
Tokens/s (wall clock) is the median of `--repeats` runs after a warm-up, sides interleaved. Not a test:
nothing asserts on time.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, md_table, median, versions  # noqa: E402
from rollout_tokens import _prompts, rollout_setup  # noqa: E402

from posttrain.rollout import SamplingParams  # noqa: E402
from posttrain.rollout.async_engine import AsyncRolloutEngine, generate_all  # noqa: E402


def tokens(groups) -> int:
    return sum(len(o.output_token_ids) for g in groups for o in g)


def episodes(engine, prompts, params, seeds) -> int:
    async def main():
        front = AsyncRolloutEngine(engine)
        try:
            outs = await asyncio.gather(*(front.generate(p, params, seed=s,
                                                         max_new_tokens=params.max_new_tokens)
                                          for p, s in zip(prompts, seeds)))
        finally:
            front.close()
        return sum(len(o.output_token_ids) for o in outs)
    return asyncio.run(main())


class BatchBoundary:
    """The engine without `stream()`: the front falls back to one batch call per group of requests."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, *args, **kwargs):
        return self.engine.generate(*args, **kwargs)


def multi_turn(engine, prompts, params, turns: int, budgets) -> int:
    """Each episode asks `turns` times, its prompt growing by what it sampled (budgets[i][k] tokens)."""
    async def episode(front, i):
        ids, n = list(prompts[i]), 0
        for k in range(turns):
            out = await front.generate(ids, params, seed=1000 * i + k, max_new_tokens=budgets[i][k])
            ids += out.output_token_ids
            n += len(out.output_token_ids)
        return n

    async def main():
        front = AsyncRolloutEngine(engine)
        try:
            return sum(await asyncio.gather(*(episode(front, i) for i in range(len(prompts)))))
        finally:
            front.close()
    return asyncio.run(main())


def timed(sides: dict, repeats: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():
        fn()
    for r in range(repeats):
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            t0 = time.perf_counter()
            n = sides[name]()
            rates[name].append(n / (time.perf_counter() - t0))
    return {name: median(v) for name, v in rates.items()}


def main(argv=None):
    args, info, _, tokenizer, engine = rollout_setup(__doc__.splitlines()[0], argv, extra=[
        ("--turns", dict(type=int, default=3, help="requests per episode in table 2"))])
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    print(f"# rollout tokens/s through the async front, {args.size} model ({info['num_parameters']:,} "
          f"params), max_new_tokens {args.max_new_tokens}")
    print(f"# {machine()}")
    print(f"# {versions()}")
    rows = []
    for batch in args.batches:
        prompts = _prompts(tokenizer, batch)
        seeds = list(range(1000, 1000 + batch))
        sides = {
            "engine.generate": lambda: tokens(engine.generate(prompts, params, seeds=seeds)),
            "generate_all": lambda: tokens(generate_all(engine, prompts, params, seeds=seeds)),
            "B episodes": lambda: episodes(engine, prompts, params, seeds),
        }
        rate = timed(sides, args.repeats)
        ref = rate["engine.generate"]
        rows.append([str(batch), f"{ref:,.0f}"] + [f"{rate[k]:,.0f} ({rate[k] / ref:.2f}x)"
                                                   for k in ("generate_all", "B episodes")])
    print(md_table(["batch", "engine.generate tok/s", "generate_all tok/s (ratio)",
                    "B episodes tok/s (ratio)"], rows))

    rng = random.Random(0)
    no_stop = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(10**9,))
    rows = []
    for batch in args.batches:
        prompts = _prompts(tokenizer, batch)
        budgets = [[rng.randint(1, args.max_new_tokens) for _ in range(args.turns)] for _ in prompts]
        sides = {"batch boundary": lambda: multi_turn(BatchBoundary(engine), prompts, no_stop, args.turns,
                                                      budgets),
                 "continuous": lambda: multi_turn(engine, prompts, no_stop, args.turns, budgets)}
        rate = timed(sides, args.repeats)
        rows.append([str(batch), str(args.turns), f"{rate['batch boundary']:,.0f}",
                     f"{rate['continuous']:,.0f} ({rate['continuous'] / rate['batch boundary']:.2f}x)"])
    print(f"# {args.turns}-turn episodes, per-request budgets drawn from 1..{args.max_new_tokens}")
    print(md_table(["episodes", "turns", "batch-boundary tok/s", "continuous tok/s (ratio)"], rows))


if __name__ == "__main__":
    main()
