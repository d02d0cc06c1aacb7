"""Aggregation, policy loss, value loss, entropy and token log-probs against hand values;
tests #4 (split invariance) and #5 (masking / padding) on the policy loss."""
import math

import pytest
import torch

from posttrain.algorithms import (
    AGGREGATIONS,
    aggregate,
    entropy,
    policy_loss,
    token_logprobs,
    value_loss,
    value_loss_with_stats,
)

close = torch.testing.assert_close
MODES = tuple(AGGREGATIONS)
LN = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# --- aggregation -------------------------------------------------------------------------------------
LOSS = t([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # third row is pure padding


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("token_mean", {}, 10 / 4),
    ("token_mean", {"num_tokens": 8}, 10 / 8),
    ("seq_mean_token_mean", {}, (2 + 4) / 2),
    ("seq_mean_token_mean", {"num_seqs": 4}, (2 + 4) / 4),
    ("seq_mean_token_sum", {}, (6 + 4) / 2),
    ("seq_sum_norm", {}, 10 / (2 * 3)),
    ("seq_sum_norm", {"num_seqs": 5, "max_len": 4}, 10 / 20),
])
def test_aggregate_hand_values(mode, kwargs, expected):
    assert aggregate(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_aggregate_ignores_non_finite_masked_values():
    loss = t([[1.0, float("nan"), float("inf")]])
    assert aggregate(loss, torch.tensor([[1, 0, 0]])).item() == 1.0


# --- policy loss -------------------------------------------------------------------------------------
RATIO = [1.5, 0.5, 1.5, 0.5]
ADV = t([[1.0, 1.0, -1.0, -1.0]])


def _ppo_inputs():
    logp = t([[LN(r) for r in RATIO]]).requires_grad_()
    return logp, torch.zeros(1, 4), ADV, torch.ones(1, 4)


def test_ppo_hand_values_and_gradient():
    logp, old, adv, mask = _ppo_inputs()
    loss, metrics = policy_loss(logp, old, adv, mask)
    # ℓ = [-min(1.5, 1.2), -min(0.5, 0.8), -min(-1.5, -1.2), -min(-0.5, -0.8)] = [-1.2, -0.5, 1.5, 0.8]
    assert loss.item() == pytest.approx(0.6 / 4)
    assert metrics["clip_ratio"].item() == pytest.approx(0.5)
    assert metrics["ppo_kl"].item() == pytest.approx(-0.5 * LN(0.75))
    assert metrics["dual_clip_frac"].item() == 0.0 and metrics["tokens"].item() == 4
    loss.backward()  # clipped positions: 0; others -ρÂ / 4
    close(logp.grad, t([[0.0, -0.125, 0.375, 0.0]]))


def test_ppo_asymmetric_clip():
    logp, old, adv, mask = _ppo_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, eps_low=0.1, eps_high=0.3)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 1.5 + 0.9) / 4)


def test_dual_clip():
    logp, old, adv, mask = t([[LN(4.0), LN(4.0)]]), torch.zeros(1, 2), t([[-1.0, 1.0]]), torch.ones(1, 2)
    loss, metrics = policy_loss(logp, old, adv, mask, dual_clip=3.0, agg="seq_mean_token_sum")
    # Â<0: -max(min(-4, -1.2), -3) = 3 ; Â>0: -min(4, 1.2) = -1.2
    assert loss.item() == pytest.approx(3.0 - 1.2)
    assert metrics["dual_clip_frac"].item() == pytest.approx(0.5)
    loss, _ = policy_loss(logp, old, adv, mask, agg="seq_mean_token_sum")
    assert loss.item() == pytest.approx(4.0 - 1.2)


def test_gspo_sequence_ratio():
    logp = t([[0.1, 0.3], [0.1, 5.0]]).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = t([[1.0, 1.0], [2.0, 2.0]])
    loss, metrics = policy_loss(logp, torch.zeros(2, 2), adv, mask, loss_type="gspo",
                                agg="seq_mean_token_mean")
    # row 0: s = e^0.2 = 1.2214 clipped to 1.2 -> -1.2 ; row 1: s = e^0.1 -> -2 e^0.1
    assert loss.item() == pytest.approx((-1.2 - 2 * math.exp(0.1)) / 2)
    assert metrics["clip_ratio"].item() == pytest.approx(2 / 3)
    loss.backward()
    close(logp.grad, t([[0.0, 0.0], [-math.exp(0.1), 0.0]]))


W = [0.25, 1.0, 8.0]  # w = exp(old - rollout) with old = 0


def _is_inputs():
    rollout = t([[-LN(w) for w in W]])
    return torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), rollout


@pytest.mark.parametrize("kind, expected_loss, stat, expected_stat", [
    ("tis", -(0.5 + 1 + 5) / 3, "is_clamp_frac", 2 / 3),       # w clamped to [0.5, 5]
    ("icepop", -1 / 3, "is_filter_frac", 2 / 3),              # w outside [0.5, 5] -> 0
    ("seq-mask-tis", -(0.25 + 1 + 8) / 3, "is_seq_filter_frac", 0.0),  # geo. mean 2^(1/3) kept
])
def test_is_correction(kind, expected_loss, stat, expected_stat):
    logp, old, adv, mask, rollout = _is_inputs()
    loss, metrics = policy_loss(logp, old, adv, mask, rollout_logp=rollout, is_correction=kind)
    assert loss.item() == pytest.approx(expected_loss)
    assert metrics[stat].item() == pytest.approx(expected_stat)
    assert metrics["rollout_kl"].item() == pytest.approx(-LN(2) / 3)
    assert metrics["logprob_abs_gap"].item() == pytest.approx(5 * LN(2) / 3)


def test_seq_mask_tis_drops_sequence():
    rollout = t([[-LN(w) for w in W], [-LN(8.0), -LN(8.0), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, metrics = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), mask,
                                rollout_logp=rollout, is_correction="seq-mask-tis")
    assert loss.item() == pytest.approx(-(0.25 + 1 + 8) / 5)   # row 1 (geo. mean 8 > 5) dropped
    assert metrics["is_seq_filter_frac"].item() == pytest.approx(0.5)
    assert metrics["is_filter_frac"].item() == pytest.approx(2 / 5)


def test_gspo_with_is_correction_uses_rollout_ratio():
    logp, old, adv, mask, rollout = _is_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, rollout_logp=rollout, is_correction="tis", loss_type="gspo")
    assert loss.item() == pytest.approx(-1.2)  # s = exp(ln2 / 3) = 1.26 -> clipped 1.2, no extra weight


# --- test #4: split invariance of the policy-loss gradient ---------------------------------------------
def _batch(seed=0, b=6, a=5):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, a, generator=g) > 0.3).long()
    mask[0] = 0  # an empty row
    mask[1, :] = 1
    return (torch.randn(b, a, generator=g) * 0.3, torch.randn(b, a, generator=g) * 0.3,
            torch.randn(b, a, generator=g), mask)


def _grad(rows_per_part, mode, logp0, old, adv, mask, trim=True, loss_type="ppo"):
    """Sum of gradients of per-part losses with global counts; each part trimmed to its own width."""
    logp = logp0.clone().requires_grad_()
    counts = {"num_tokens": int(mask.sum()), "num_seqs": int((mask.sum(1) > 0).sum()),
              "max_len": mask.shape[1]}
    for rows in rows_per_part:
        m = mask[rows]
        width = int(m.nonzero()[:, 1].max()) + 1 if trim and m.any() else m.shape[1]
        loss, _ = policy_loss(logp[rows][:, :width], old[rows][:, :width], adv[rows][:, :width],
                              m[:, :width], agg=mode, dual_clip=3.0, loss_type=loss_type, **counts)
        loss.backward()
    return logp.grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ["ppo", "seq_sum"])
def test_gradient_identical_across_micro_batches_and_ranks(mode, loss_type):
    logp, old, adv, mask = _batch()
    full = _grad([list(range(6))], mode, logp, old, adv, mask, trim=False, loss_type=loss_type)
    accumulated = _grad([[0, 1], [2, 3], [4, 5]], mode, logp, old, adv, mask, loss_type=loss_type)
    ranks = [[0, 2], [4], [1, 3], [5]]  # rank 0: 2 micro-batches, rank 1: 2 micro-batches
    two_ranks = _grad(ranks, mode, logp, old, adv, mask, loss_type=loss_type)
    assert full.abs().sum() > 0
    close(accumulated, full, atol=1e-6, rtol=1e-5)
    close(two_ranks, full, atol=1e-6, rtol=1e-5)


# --- test #5: masked positions / padding -----------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "seq_sum"])
def test_masked_positions_get_zero_gradient_even_with_garbage(mode, loss_type):
    logp0, old, adv, mask = _batch(seed=1)
    bad = mask == 0
    logp0 = logp0.masked_fill(bad, float("nan"))
    old = old.masked_fill(bad, float("inf"))
    adv = adv.masked_fill(bad, -1e30)
    rollout = old.clone().masked_fill(~bad, 0.1)
    logp = logp0.requires_grad_()
    loss, metrics = policy_loss(logp, old.masked_fill(~bad, 0.0), adv, mask, agg=mode, loss_type=loss_type,
                                rollout_logp=rollout, is_correction="tis", dual_clip=2.0)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    assert torch.equal(logp.grad[bad], torch.zeros(int(bad.sum())))
    assert logp.grad[~bad].abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
def test_padding_changes_no_loss_or_metric(mode):
    logp, old, adv, mask = _batch(seed=2)
    rollout = old + 0.05
    kw = {"agg": mode, "max_len": 8, "rollout_logp": rollout, "is_correction": "icepop"}
    loss, metrics = policy_loss(logp, old, adv, mask, **kw)
    pad = lambda x, v: torch.cat([torch.cat([x, torch.full((6, 3), v)], 1), torch.full((2, 8), v)], 0)
    loss_p, metrics_p = policy_loss(pad(logp, 3.0), pad(old, -7.0), pad(adv, 5.0),
                                    pad(mask, 0).long(), **{**kw, "rollout_logp": pad(rollout, 9.0)})
    close(loss_p, loss)
    assert metrics.keys() == metrics_p.keys()
    for k in metrics:
        close(metrics_p[k], metrics[k])


# --- value loss --------------------------------------------------------------------------------------------
def test_value_loss_hand_values():
    v, old, g, mask = (t([[1.0, 2.0, 50.0]]), t([[0.5, 2.0, 0.0]]), t([[2.0, 1.0, 0.0]]),
                       torch.tensor([[1, 1, 0]]))
    # clip 0.2: pos 0 max((0.7-2)², (1-2)²) = 1.69 ; pos 1: max(1, 1) = 1
    loss, stats = value_loss_with_stats(v, old, g, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    assert stats["value_clip_frac"].item() == pytest.approx(0.5)
    assert value_loss(v, old, g, mask).item() == pytest.approx(0.5)
    vv = v.clone().requires_grad_()
    value_loss(vv, old, g, mask, clip=0.2).backward()
    close(vv.grad, t([[0.0, 0.5, 0.0]]))  # pos 0: clipped term chosen -> no gradient; pos 1: 0.5·2·1/2


# --- entropy / log-probs ------------------------------------------------------------------------------------
def test_entropy_hand_values():
    h = 0.25 * LN(4) + 0.75 * LN(4 / 3)  # p = [1/4, 3/4]
    logits = t([[0.0, 0.0], [0.0, LN(3)]])
    close(entropy(logits), t([LN(2), h]))
    close(entropy(t([[0.0, 2 * LN(3)]]), temperature=2.0), t([h]))
    x = t([[0.0, 0.0, float("-inf")]]).requires_grad_()
    e = entropy(x)
    e.sum().backward()
    assert e.item() == pytest.approx(LN(2)) and torch.isfinite(x.grad).all()
    assert entropy(torch.zeros(2, 3, 5).bfloat16()).dtype == torch.float32


def test_token_logprobs_hand_values_and_no_in_place():
    logits = t([[[0.0, LN(3)], [0.0, LN(3)]]])
    close(token_logprobs(logits, torch.tensor([[1, 0]])), t([[LN(0.75), LN(0.25)]]))
    scaled = t([[[0.0, 2 * LN(3)]]])
    before = scaled.clone()
    close(token_logprobs(scaled, torch.tensor([[1]]), temperature=2.0), t([[LN(0.75)]]))
    assert torch.equal(scaled, before)
    out = token_logprobs(scaled.bfloat16(), torch.tensor([[1]]), temperature=2.0)
    assert out.dtype == torch.float32


def test_token_logprobs_match_sampling_distribution_at_temperature():
    """Test #3 at the math level: exp(token_logprobs) is the distribution sampled at temperature T."""
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(11).expand(2, 3, 11)
    for temp in (0.7, 1.3):
        lp = torch.stack([token_logprobs(logits, labels[..., v], temp) for v in range(11)], -1)
        close(lp.exp(), torch.softmax(logits / temp, -1))


def test_low_precision_inputs_computed_in_float32():
    logp, old, adv, mask = _ppo_inputs()
    loss, metrics = policy_loss(logp.detach().bfloat16(), old.bfloat16(), adv.bfloat16(), mask)
    assert loss.dtype == torch.float32 and metrics["clip_ratio"].dtype == torch.float32
    v = t([[1.0, 2.0]]).half()
    assert value_loss(v, v, v + 1, torch.ones(1, 2)).dtype == torch.float32


def test_token_mean_over_two_micro_batches_is_the_steps_token_mean_not_the_mean_of_means():
    """docs/algorithms.md's worked example: one token with loss 1, then three with loss 3 (4 tokens
    in the step)."""
    first, second = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[3.0, 3.0, 3.0]])
    m1, m2 = torch.tensor([[1.0, 0.0, 0.0]]), torch.ones(1, 3)
    step = (aggregate(first, m1, "token_mean", num_tokens=4)
            + aggregate(second, m2, "token_mean", num_tokens=4))
    assert step.item() == pytest.approx(2.5)
    # OpenRLHF 0.10.2
    per_micro_batch = (aggregate(first, m1, "token_mean") + aggregate(second, m2, "token_mean")) / 2
    assert per_micro_batch.item() == pytest.approx(2.0)
