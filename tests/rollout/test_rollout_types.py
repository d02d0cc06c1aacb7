"""SamplingParams / RolloutOutput validation, rank_seed, and the one-step sampler."""
import math

import pytest
import torch

from posttrain.algorithms.losses import token_logprobs
from posttrain.rollout import RolloutOutput, SamplingParams, rank_seed, sample_next


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.max_new_tokens, p.n, p.seed, p.stop_token_ids, p.min_tokens) == (
        1.0, 1.0, 16, 1, None, None, 1)  # min_tokens 1: OpenRLHF's vLLM default, never an empty response
    assert SamplingParams(stop_token_ids=[2, 0]).stop_token_ids == (2, 0)
    greedy = SamplingParams(temperature=0)
    assert greedy.greedy and greedy.logprob_temperature == 1.0
    assert SamplingParams(temperature=0.7).logprob_temperature == 0.7


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", True),
    ("max_new_tokens", 0), ("max_new_tokens", 2.0),
    ("n", 0), ("n", True),
    ("seed", -1), ("seed", 1.5), ("seed", 2**63),
    ("stop_token_ids", "2"), ("stop_token_ids", [2, -1]), ("stop_token_ids", 2),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True),
])
def test_sampling_params_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_rollout_output_validation():
    out = RolloutOutput([1, 2], [3, 4], [-0.1, -0.2], "length")
    assert out.truncated
    with pytest.raises(ValueError, match="2 logprobs for 1 output tokens"):
        RolloutOutput([1], [3], [-0.1, -0.2], "stop")
    with pytest.raises(ValueError, match="finish_reason='abort'"):
        RolloutOutput([1], [3], [-0.1], "abort")


def test_rank_seed_distinct_deterministic_and_validated():
    seeds = {rank_seed(42, r, s) for r in range(64) for s in range(50)}
    assert len(seeds) == 64 * 50
    assert all(0 <= s < 2**63 for s in seeds)
    assert rank_seed(42, 3, 7) == rank_seed(42, 3, 7) != rank_seed(43, 3, 7)
    for args, name in [((-1, 0, 0), "base_seed"), ((0, 1.0, 0), "rank"), ((0, 0, -2), "step")]:
        with pytest.raises(ValueError, match=f"{name}="):
            rank_seed(*args)


P = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _counts(tokens, v=4):
    return torch.bincount(tokens, minlength=v).double() / tokens.numel()


def test_sample_next_matches_the_distribution_and_reports_full_logprobs():
    logits = P.log().repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, lp = sample_next(logits, 1.0, 1.0, gen)
    freq = _counts(tokens)
    sigma = (P * (1 - P) / 20000).sqrt().double()
    assert torch.all((freq - P.double()).abs() < 4 * sigma), freq
    assert torch.allclose(lp, P.log()[tokens], atol=1e-6)


def test_sample_next_top_p_keeps_the_nucleus_but_not_its_renormalisation():
    logits = P.log().repeat(20000, 1)
    gen = torch.Generator().manual_seed(1)
    tokens, lp = sample_next(logits, 1.0, 0.7, gen)  # nucleus {0, 1}: mass 0.8 >= 0.7
    freq = _counts(tokens)
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0] - 0.5 / 0.8) < 0.02
    assert torch.allclose(lp, P.log()[tokens], atol=1e-6)  # log 0.5 / log 0.3, not log 0.625 / log 0.375
    tokens, _ = sample_next(logits, 1.0, 0.9, gen)  # nucleus {0, 1, 2}
    assert _counts(tokens)[3] == 0 and _counts(tokens)[2] > 0.1
    tokens, _ = sample_next(logits, 1.0, 0.01, gen)  # the top token always stays
    assert torch.all(tokens == 0)


def test_sample_next_temperature_and_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5]])
    gen = torch.Generator().manual_seed(2)
    tokens, lp = sample_next(logits, 1.7, 1.0, gen)
    assert torch.allclose(lp, torch.log_softmax(logits / 1.7, -1).gather(-1, tokens[:, None]).squeeze(-1),
                          atol=1e-6)
    tokens, lp = sample_next(logits, 0, 1.0, gen)
    assert tokens.tolist() == [0, 1]
    assert torch.allclose(lp, token_logprobs(logits, tokens, 1.0))
    assert math.isclose(lp[0].item(), 2.0 - math.log(sum(math.exp(x) for x in (2.0, 1.0, 0.0, -1.0))),
                        rel_tol=1e-6)


def test_sample_next_banned_tokens_are_never_drawn_and_keep_full_logprobs():
    """probs [.5, .3, .2] with token 0 banned (min_tokens): the draw maps u·0.5 onto the cdf [0, .3, .5], the
    log-prob stays log p of the unbanned distribution; the nucleus is top_p of the remaining mass."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log().repeat(3, 1)
    banned = torch.tensor([[True, False, False]] * 3)
    u = torch.tensor([0.0, 0.5, 0.7], dtype=torch.float64)
    tokens, lp = sample_next(logits, 1.0, 1.0, None, u, banned)
    assert tokens.tolist() == [1, 1, 2]  # u 0.5 → 0.25 < 0.3; u 0.7 → 0.35 >= 0.3
    assert torch.allclose(lp, torch.tensor([0.3, 0.3, 0.2]).log(), atol=1e-6)
    # top_p 0.5 of the remaining 0.5 keeps token 1 alone (0.3 >= 0.25); of the whole mass it would keep
    # 1 and 2
    tokens, _ = sample_next(logits, 1.0, 0.5, None, torch.tensor([0.9] * 3, dtype=torch.float64), banned)
    assert tokens.tolist() == [1, 1, 1]
    tokens, lp = sample_next(logits, 0, 1.0, None, None, banned)  # greedy: the best allowed token
    assert tokens.tolist() == [1, 1, 1] and torch.allclose(lp, torch.tensor([0.3] * 3).log(), atol=1e-6)
    everything = torch.ones(3, 3, dtype=torch.bool)  # nothing left to draw: the row is sampled unbanned
    assert sample_next(logits, 0, 1.0, None, None, everything)[0].tolist() == [0, 0, 0]


def test_sample_next_seeded_generator_is_reproducible():
    logits = torch.randn(8, 50)
    a = sample_next(logits, 1.0, 0.9, torch.Generator().manual_seed(5))[0]
    b = sample_next(logits, 1.0, 0.9, torch.Generator().manual_seed(5))[0]
    c = torch.stack([sample_next(logits, 1.0, 0.9, torch.Generator().manual_seed(s))[0]
                     for s in range(6, 10)])
    assert torch.equal(a, b)
    assert not all(torch.equal(a, row) for row in c)
