"""Rollout throughput through the async front (`engines/rollout/async_engine.py`) against the batch
engine it wraps, on the same model and prompts.

    .venv/bin/python bench/rollout_async.py [--size tiny] [--batches 16 64] [--max-new-tokens 32] [--repeats 5]

Three ways to sample one batch of B prompts (temperature 1, per-prompt seeds, the same budgets):
  - `engine.generate`: today's single batch call (the reference);
  - `generate_all`: the single-turn executor's path, every request submitted to the front at once;
  - `B episodes`: B coroutines each awaiting `front.generate` for one prompt, as agent episodes do
    (each request carries its own seed, so the samples equal the batch call's seeds per prompt).
Tokens/s (wall clock) is the median of `--repeats` runs after a warm-up, sides interleaved; the ratio is
against `engine.generate` in the same run. Not a test: nothing asserts on time.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, md_table, median, versions  # noqa: E402
from rollout_tokens import _prompts, rollout_setup  # noqa: E402

from posttrain.engines.rollout import SamplingParams  # noqa: E402
from posttrain.engines.rollout.async_engine import AsyncRolloutEngine, generate_all  # noqa: E402


def tokens(groups) -> int:
    return sum(len(o.output_token_ids) for g in groups for o in g)


def episodes(engine, prompts, params, seeds) -> int:
    async def main():
        front = AsyncRolloutEngine(engine)
        try:
            outs = await asyncio.gather(*(front.generate(p, params, seed=s, max_new_tokens=params.max_new_tokens)
                                          for p, s in zip(prompts, seeds)))
        finally:
            front.close()
        return sum(len(o.output_token_ids) for o in outs)
    return asyncio.run(main())


def main(argv=None):
    args, info, _, tokenizer, engine = rollout_setup(__doc__.splitlines()[0], argv)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    print(f"# rollout tokens/s through the async front, {args.size} model ({info['num_parameters']:,} params), "
          f"max_new_tokens {args.max_new_tokens}")
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
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for fn in sides.values():
            fn()
        for r in range(args.repeats):
            for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
                t0 = time.perf_counter()
                n = sides[name]()
                rates[name].append(n / (time.perf_counter() - t0))
        ref = median(rates["engine.generate"])
        rows.append([str(batch), f"{ref:,.0f}"] + [f"{median(rates[k]):,.0f} ({median(rates[k]) / ref:.2f}x)"
                                                   for k in ("generate_all", "B episodes")])
    print(md_table(["batch", "engine.generate tok/s", "generate_all tok/s (ratio)", "B episodes tok/s (ratio)"], rows))


if __name__ == "__main__":
    main()
