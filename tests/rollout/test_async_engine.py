"""The async front (rollout/async_engine.py): the single-turn path through it is the plain
batch call; concurrent requests share engine calls; errors reach every caller; it runs inside a
running event loop (notebooks)."""
import asyncio

import pytest

from posttrain.rollout import SamplingParams
from posttrain.rollout.async_engine import AsyncRolloutEngine, generate_all

PROMPTS = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14]]


class Counting:
    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params, **kwargs):
        self.calls.append((len(prompts), sorted(kwargs)))
        return self.engine.generate(prompts, params, **kwargs)


def test_generate_all_is_the_one_batch_call(engine):
    params = SamplingParams(temperature=1.0, n=3, seed=4, max_new_tokens=5)
    seeds, budgets = [11, 12, 13, 14], [5, 2, 4, 1]
    direct = engine.generate(PROMPTS, params, max_new_tokens=budgets, seeds=seeds)
    spy = Counting(engine)
    front = generate_all(spy, PROMPTS, params, max_new_tokens=budgets, seeds=seeds)
    assert spy.calls == [(4, ["max_new_tokens", "seeds"])]
    assert [[o.output_token_ids for o in g] for g in front] == [[o.output_token_ids for o in g]
                                                                for g in direct]
    assert [[o.logprobs for o in g] for g in front] == [[o.logprobs for o in g] for g in direct]
    generate_all(spy, PROMPTS, SamplingParams(n=2, max_new_tokens=3))  # unseeded, no budgets: passed as such
    assert spy.calls[-1] == (4, [])


def test_the_front_works_inside_a_running_event_loop(engine):
    async def notebook_cell():
        return generate_all(engine, PROMPTS[:2], SamplingParams(n=1, seed=1, max_new_tokens=2))
    out = asyncio.run(notebook_cell())
    assert len(out) == 2 and all(len(g) == 1 for g in out)


def test_an_engine_error_reaches_every_waiting_caller():
    class Broken:
        def generate(self, *args, **kwargs):
            raise RuntimeError("engine down")

    async def main():
        front = AsyncRolloutEngine(Broken())
        try:
            return await asyncio.gather(*(front.generate(p, SamplingParams(), seed=1, max_new_tokens=2)
                                          for p in PROMPTS),
                                        return_exceptions=True)
        finally:
            front.close()
    errors = asyncio.run(main())
    assert [str(e) for e in errors] == ["engine down"] * 4
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        asyncio.run(AsyncRolloutEngine(Broken()).generate([1], SamplingParams(), seed=1, max_new_tokens=0))


def test_requests_with_different_budgets_share_one_batch(engine):
    """Episodes ask with their own remaining budgets: that must not split the batch."""
    spy = Counting(engine)

    async def main():
        front = AsyncRolloutEngine(spy)
        try:
            return await asyncio.gather(*(front.generate(p, SamplingParams(max_new_tokens=k + 1), seed=k,
                                                         max_new_tokens=k + 1)
                                          for k, p in enumerate(PROMPTS)))
        finally:
            front.close()
    outs = asyncio.run(main())
    assert spy.calls == [(4, ["max_new_tokens", "seeds"])]
    assert [len(o.output_token_ids) <= k + 1 for k, o in enumerate(outs)] == [True] * 4


def test_an_engine_returning_too_few_results_fails_its_callers_instead_of_hanging():
    class Short:
        def generate(self, prompts, params, **kwargs):
            return [[]] * (len(prompts) - 1)

    async def main():
        front = AsyncRolloutEngine(Short())
        try:
            return await asyncio.wait_for(asyncio.gather(
                *(front.generate(p, SamplingParams(), seed=1, max_new_tokens=2) for p in PROMPTS),
                return_exceptions=True), 10)
        finally:
            front.close()
    errors = asyncio.run(main())
    assert all(isinstance(e, RuntimeError) and "returned 3 results for 4 prompts" in str(e) for e in errors)


def test_generate_all_checks_the_engine_contract_and_fills_missing_budgets(engine):
    class Short:
        def generate(self, prompts, params, **kwargs):
            return engine.generate(prompts, params, **kwargs)[:-1]

    with pytest.raises(RuntimeError, match="3 results for 4 prompts .* breaks its contract"):
        generate_all(Short(), PROMPTS, SamplingParams(n=1, seed=1, max_new_tokens=2))
    spy = Counting(engine)
    params = SamplingParams(n=1, seed=2, max_new_tokens=4, stop_token_ids=[])
    out = generate_all(spy, PROMPTS, params, max_new_tokens=[1, None, 2, None])
    assert [len(g[0].output_token_ids) for g in out] == [1, 4, 2, 4]
