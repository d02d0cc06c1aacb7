"""Split-invariant sampling: a prompt's samples depend only on its seed (``seeds[i]``, else
``rank_seed(params.seed, 0, i)``) and the sample index, not on the other prompts, its position in
the call, the ``batch_size`` chunking, or how a step's prompts are split into calls (engines)."""
import pytest
import torch

from posttrain.data import Prompt
from posttrain.rewards import RewardResult
from posttrain.rollout import HFRolloutEngine, SamplingParams, rank_seed, sample_next
from posttrain.rollout.decode_batch import Sequence
from posttrain.rollout.single_turn import SingleTurnSampler

PROMPTS = [[5, 17, 300, 42, 9], [11], [700, 701, 702, 703, 704, 705, 706, 707, 708], [64, 65, 66]]
FREQUENT_STOPS = list(range(100, 300))  # ~10% of the vocabulary: samples stop at varied lengths, rows compact
BASE = 21


def params(**kw):
    base = dict(temperature=1.0, top_p=0.95, max_new_tokens=12, n=3, seed=BASE, stop_token_ids=FREQUENT_STOPS)
    base.update(kw)
    return SamplingParams(**base)


def seeds_for(indices, base=BASE):
    return [rank_seed(base, 0, i) for i in indices]


def assert_same(got, ref):
    assert len(got) == len(ref)
    for g_group, r_group in zip(got, ref):
        assert len(g_group) == len(r_group)
        for g, r in zip(g_group, r_group):
            assert g.output_token_ids == r.output_token_ids
            assert g.finish_reason == r.finish_reason
            assert g.prompt_token_ids == r.prompt_token_ids
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=1e-6, rtol=0)


def test_split_across_calls_equals_one_call(engine):
    full = engine.generate(PROMPTS, params())
    assert {o.finish_reason for g in full for o in g} == {"stop", "length"}  # rows finish early and compact
    assert len({tuple(o.output_token_ids) for o in full[0]}) == 3  # the n samples differ
    assert full == engine.generate(PROMPTS, params(), seeds=seeds_for(range(4)))  # the default derivation
    halves = (engine.generate(PROMPTS[:2], params(), seeds=seeds_for([0, 1]))
              + engine.generate(PROMPTS[2:], params(), seeds=seeds_for([2, 3])))
    assert_same(halves, full)


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_batch_size_chunking_changes_nothing(engine, batch_size):
    full = engine.generate(PROMPTS, params())
    chunked = HFRolloutEngine(engine.model, [2], pad_token_id=0,
                              batch_size=batch_size).generate(PROMPTS, params())
    assert_same(chunked, full)


def test_samples_do_not_depend_on_position(engine):
    seeds = seeds_for(range(4))
    full = engine.generate(PROMPTS, params(), seeds=seeds)
    order = [3, 1, 0, 2]
    shuffled = engine.generate([PROMPTS[i] for i in order], params(), seeds=[seeds[i] for i in order])
    assert_same(shuffled, [full[i] for i in order])
    alone = [engine.generate([PROMPTS[i]], params(), seeds=[seeds[i]])[0] for i in range(4)]
    assert_same(alone, full)
    # the same prompt twice with different seeds gives different samples
    twice = engine.generate([PROMPTS[0], PROMPTS[0]], params(), seeds=[seeds[0], seeds[1]])
    assert [o.output_token_ids for o in twice[0]] == [o.output_token_ids for o in full[0]]
    assert [o.output_token_ids for o in twice[1]] != [o.output_token_ids for o in twice[0]]


def test_unseeded_derives_per_prompt_seeds_from_the_global_rng(engine):
    unseeded = params(seed=None)
    torch.manual_seed(3)
    first = engine.generate(PROMPTS, unseeded)
    torch.manual_seed(3)
    base = int(torch.randint(0, 2**63 - 1, (1,)).item())
    assert_same(engine.generate(PROMPTS, unseeded, seeds=seeds_for(range(4), base)), first)


def test_greedy_with_seeds(engine):
    greedy = params(temperature=0, n=2)
    a = engine.generate(PROMPTS, greedy, seeds=seeds_for(range(4)))
    b = engine.generate(PROMPTS, greedy, seeds=[7, 8, 9, 10])
    assert_same(a, b)


def test_bad_seeds(engine):
    with pytest.raises(ValueError, match="seeds has 3 entries for 4 prompts"):
        engine.generate(PROMPTS, params(), seeds=[1, 2, 3])
    with pytest.raises(ValueError, match=r"seeds holds -1; every seed must be an integer in \[0, 2\*\*63\)"):
        engine.generate(PROMPTS, params(), seeds=[1, -1, 2, 3])
    with pytest.raises(ValueError, match=r"seeds holds 9223372036854775808"):
        engine.generate(PROMPTS[:1], params(), seeds=[2**63])
    with pytest.raises(ValueError, match="seeds holds 1.5"):
        engine.generate(PROMPTS[:1], params(), seeds=[1.5])
    with pytest.raises(ValueError, match="seeds must be None or a list"):
        engine.generate(PROMPTS[:1], params(), seeds=7)


def test_sample_next_with_one_generator_per_row():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]  # noqa: E731
    tokens, lp = sample_next(logits, 1.0, 0.9, gens())
    for b in range(4):  # row b alone, with its own generator, draws the same token
        alone, alone_lp = sample_next(logits[b:b + 1], 1.0, 0.9, [torch.Generator().manual_seed(b + 1)])
        assert alone.item() == tokens[b].item() and alone_lp.item() == lp[b].item()
    assert torch.equal(sample_next(logits, 0, 1.0, gens())[0], logits.argmax(-1))
    with pytest.raises(ValueError, match="3 generators for 4 rows"):
        sample_next(logits, 1.0, 1.0, gens()[:3])


def test_block_draws_are_the_generators_one_by_one_draws():
    """The decode loop takes each sample's uniforms from its generator 64 at a time
    (`Sequence.uniform`): a CPU generator must give the same float64 numbers as one draw per step
    (what `sample_next` with that generator draws), so the samples equal per-step sampling."""
    seq = Sequence(prompt=[1], limit=200, temperature=1.0, top_p=1.0, stop=frozenset(),
                   generator=torch.Generator().manual_seed(11))
    one_by_one = torch.Generator().manual_seed(11)
    for _ in range(150):  # across block boundaries
        assert seq.uniform() == torch.rand(1, generator=one_by_one, dtype=torch.float64).item()
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)]
    uniforms = torch.tensor([torch.rand(1, generator=torch.Generator().manual_seed(s),
                                        dtype=torch.float64).item()
                             for s in (1, 2, 3, 4)], dtype=torch.float64)
    for top_p in (1.0, 0.9):
        by_generator = sample_next(logits, 0.7, top_p,
                                   [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)])
        by_uniforms = sample_next(logits, 0.7, top_p, gens, uniforms)
        assert torch.equal(by_generator[0], by_uniforms[0]) and torch.equal(by_generator[1], by_uniforms[1])
    # given uniforms, generators are unused
    assert [g.initial_seed() for g in gens] == [1, 2, 3, 4] and torch.rand(1, generator=gens[0]).item() == \
        torch.rand(1, generator=torch.Generator().manual_seed(1)).item()


class Zero:
    def score_tokens(self, sequences):
        return RewardResult(torch.zeros(len(sequences)))


def test_executor_seeds_prompts_by_their_index_in_the_step(engine, tokenizer):
    executor = SingleTurnSampler(engine, Zero(), tokenizer)
    prompts = [Prompt(f"p{i}", p, None, "") for i, p in enumerate(PROMPTS)]
    whole = executor.run(prompts, params())
    tail = executor.run(prompts[2:], params(), group_offset=2)
    assert [r.group for r in tail.rollouts] == [2, 2, 2, 3, 3, 3]
    assert [r.output_ids for r in tail.rollouts] == [r.output_ids for r in whole.rollouts[6:]]
    for t, w in zip(tail.rollouts, whole.rollouts[6:]):
        assert t.rollout_logprobs == pytest.approx(w.rollout_logprobs, abs=1e-6)
    head = executor.run(prompts[2:], params())  # group_offset 0: the seeds of prompts 0 and 1
    assert [r.output_ids for r in head.rollouts] != [r.output_ids for r in tail.rollouts]
    # the engine gets the seeds of the global indices
    seen = []

    class Spy:
        def generate(self, prompt_token_ids, params, max_new_tokens=None, seeds=None):
            seen.append(seeds)
            return engine.generate(prompt_token_ids, params, max_new_tokens=max_new_tokens, seeds=seeds)

    SingleTurnSampler(Spy(), Zero(), tokenizer).run(prompts[2:], params(), group_offset=2)
    SingleTurnSampler(Spy(), Zero(), tokenizer).run(prompts[2:], params(seed=None), group_offset=2)
    assert seen == [seeds_for([2, 3]), None]
