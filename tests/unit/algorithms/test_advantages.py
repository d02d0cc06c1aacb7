"""Advantage pipeline against hand-computed values, and test #8 (group estimators)."""
import math
import warnings

import pytest
import torch

from posttrain.algorithms import (
    ESTIMATORS,
    compute_advantages,
    compute_advantages_with_stats,
    discounted_returns,
    gae,
    group_baseline,
    token_rewards,
    token_rewards_with_stats,
    whiten,
)
from posttrain.algorithms import advantages as adv_module

GROUP = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")
close = torch.testing.assert_close


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# --- group baselines (group 1: [1, 2, 6]; group 2 constant) --------------------------------------
R = t([1.0, 2.0, 6.0, 4.0, 4.0, 4.0])


@pytest.mark.parametrize("estimator, expected", [
    ("rloo", [-3.0, -1.5, 4.5, 0, 0, 0]),                 # r_i - (9 - r_i)/2
    ("reinforce_baseline", [-2.0, -1.0, 3.0, 0, 0, 0]),   # r_i - 3
    ("dr_grpo", [-2.0, -1.0, 3.0, 0, 0, 0]),
    ("group_norm", [-0.75592895, -0.37796447, 1.13389342, 0, 0, 0]),  # (r_i - 3) / sqrt(14/2)
    ("gae", [1.0, 2.0, 6.0, 4.0, 4.0, 4.0]),
    ("reinforce", [1.0, 2.0, 6.0, 4.0, 4.0, 4.0]),
])
def test_group_baseline_hand_values(estimator, expected):
    close(group_baseline(R, 3, estimator), t(expected))


@pytest.mark.parametrize("estimator", GROUP)
def test_group_estimators_need_n_at_least_2(estimator):
    with pytest.raises(ValueError, match=r"n=1.*n >= 2"):
        group_baseline(t([1.0, 2.0]), 1, estimator)
    with pytest.raises(ValueError, match=r"n=1"):
        compute_advantages(estimator, t([1.0, 2.0]), torch.ones(2, 2), n=1)
    with pytest.raises(ValueError, match=r"not divisible by n=2"):
        group_baseline(t([1.0, 2.0, 3.0]), 2, estimator)


def test_bf16_rewards_computed_in_float32():
    out = group_baseline(t([1.0, 2.0]).bfloat16(), 2, "rloo")
    assert out.dtype == torch.float32
    close(out, t([-1.0, 1.0]))


# --- token rewards ---------------------------------------------------------------------------------
def test_token_rewards_last_masked_position_clip_and_kl():
    rewards = t([2.0, 15.0, 1.0])
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 1, 0]])  # right pad, left pad, multi-turn gap
    kl = t([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 0.6, 9.0], [0.2, 9.0, 0.4, 9.0]])
    out, stats = token_rewards_with_stats(rewards, kl, mask, kl_coef=0.5, clip_range=(-10.0, 10.0))
    close(out, t([[-0.05, 1.9, 0.0, 0.0],
                  [0.0, -0.25, 9.7, 0.0],     # 15 clipped to 10, then - 0.5 * 0.6
                  [-0.1, 0.0, 0.8, 0.0]]))
    assert stats["reward_clip_count"].item() == 1 and stats["empty_rows"].item() == 0
    close(token_rewards(rewards, None, mask, 0.0, clip_range=None)[1], t([0.0, 0.0, 15.0, 0.0]))


def test_token_rewards_reports_rows_without_tokens():
    _, stats = token_rewards_with_stats(t([1.0, 2.0]), None, torch.tensor([[1, 0], [0, 0]]), 0.0)
    assert stats["empty_rows"].item() == 1


# --- returns / GAE / whitening ---------------------------------------------------------------------
def test_discounted_returns_hand_values():
    rew = t([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    close(discounted_returns(rew, mask, 0.5), t([[3.0, 4.0, 4.0], [2.0, 2.0, 0.0]]))
    close(discounted_returns(rew, mask, 1.0), t([[7.0, 6.0, 4.0], [3.0, 2.0, 0.0]]))


def test_gae_hand_values():
    rew = t([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])
    values = t([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rew, values, mask, gamma=0.9, lam=0.8)
    # row 0: δ = [0.04, 0.03, 0.3]; Â2 = 0.3, Â1 = 0.03 + 0.72*0.3, Â0 = 0.04 + 0.72*Â1
    # row 1: position 2 masked (R, V -> 0): δ = [0.04, 0.4]; Â = [0.328, 0.4]
    close(adv, t([[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]]))
    close(ret, t([[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0]]))


def test_whiten_hand_values():
    a = t([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    close(whiten(a, mask), t([[-1.22474487, 0.0, 1.22474487, 0.0]]))  # pop. std sqrt(2/3)
    close(whiten(a, mask, use_std=False), t([[-1.0, 0.0, 1.0, 0.0]]))
    close(whiten(t([[5.0, 5.0]]), torch.ones(1, 2)), t([[0.0, 0.0]]))  # var 0 -> eps, no NaN


# --- full pipeline ---------------------------------------------------------------------------------
def test_rloo_pipeline_and_whiten_flag():
    rewards, mask = t([1.0, 3.0, 2.0, 2.0]), torch.ones(4, 2)
    adv, ret = compute_advantages("rloo", rewards, mask, n=2)
    expected = t([[-2.0, -2.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]])
    close(adv, expected)
    close(ret, expected)
    adv, ret = compute_advantages("rloo", rewards, mask, n=2, whiten=True)  # mean 0, pop. var 2
    close(adv, expected / 2 ** 0.5)
    close(ret, expected)  # returns are never whitened


def test_sequence_kl_vs_token_kl():
    rewards, mask, kl = t([1.0, 1.0]), torch.ones(2, 2), t([[0.5, 0.5], [0.0, 0.0]])
    # sequence_kl: r' = [1 - 1, 1 - 0] -> rloo [-1, 1], broadcast to the tokens
    adv, _ = compute_advantages("rloo", rewards, mask, n=2, kl=kl, kl_coef=1.0, sequence_kl=True)
    close(adv, t([[-1.0, -1.0], [1.0, 1.0]]))
    # token KL: baseline of [1, 1] is 0; rewards [-0.5, -0.5] summed to go
    adv, _ = compute_advantages("rloo", rewards, mask, n=2, kl=kl, kl_coef=1.0)
    close(adv, t([[-1.0, -0.5], [0.0, 0.0]]))


def test_reinforce_whitening_and_std_norm():
    rewards, mask = t([1.0, 0.0]), torch.tensor([[1, 1], [1, 0]])
    adv, ret = compute_advantages("reinforce", rewards, mask, n=1)
    # returns [[1, 1], [0, -]]: mean 2/3, pop. var 2/9
    close(adv, t([[0.70710678, 0.70710678], [-1.41421356, 0.0]]))
    close(ret, t([[1.0, 1.0], [0.0, 0.0]]))
    adv, _ = compute_advantages("reinforce", rewards, mask, n=1, std_norm=False)
    close(adv, t([[1 / 3, 1 / 3], [-2 / 3, 0.0]]))
    adv, _ = compute_advantages("reinforce", rewards, mask, n=1, whiten=False)
    close(adv, ret)


def test_gae_pipeline_flags():
    rewards, mask = t([1.0, 1.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    values = t([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    raw, ret = compute_advantages("gae", rewards, mask, n=1, values=values, gamma=0.9, lam=0.8, whiten=False)
    close(raw, t([[0.21712, 0.246, 0.3], [0.328, 0.4, 0.0]]))   # same numbers as test_gae_hand_values
    close(ret, t([[0.71712, 0.846, 1.0], [0.828, 1.0, 0.0]]))
    default, _ = compute_advantages("gae", rewards, mask, n=1, values=values, gamma=0.9, lam=0.8)
    close(default, whiten(raw, mask))
    centered, _ = compute_advantages("gae", rewards, mask, n=1, values=values, gamma=0.9, lam=0.8,
                                     std_norm=False)
    close(centered, whiten(raw, mask, use_std=False))


def test_clip_range_applied_after_baseline():
    adv, _, stats = compute_advantages_with_stats("rloo", t([30.0, 0.0]), torch.ones(2, 1), n=2)
    close(adv, t([[10.0], [-10.0]]))  # baseline [30, -30], then clipped
    assert stats["reward_clip_count"].item() == 2
    adv, _ = compute_advantages("rloo", t([30.0, 0.0]), torch.ones(2, 1), n=2, clip_range=None)
    close(adv, t([[30.0], [-30.0]]))


@pytest.mark.parametrize("estimator, expected", [
    ("rloo", [-1.0, 1.0, -2.0, 2.0]),
    ("dr_grpo", [-0.5, 0.5, -1.0, 1.0]),
    ("group_norm", [-0.70710678, 0.70710678, -0.70710678, 0.70710678]),  # unbiased std of 2 = |a-b|/√2
])
def test_never_whitened_by_default(estimator, expected):
    adv, _, stats = compute_advantages_with_stats(estimator, t([1.0, 2.0, 3.0, 5.0]), torch.ones(4, 2), n=2)
    assert stats["whitened"] is False
    close(adv, t(expected)[:, None].expand(4, 2), atol=1e-6, rtol=1e-6)


def test_reinforce_baseline_whitened_by_default():
    adv, _ = compute_advantages("reinforce_baseline", t([1.0, 2.0, 3.0, 5.0]), torch.ones(4, 1), n=2)
    # baseline [-0.5, 0.5, -1, 1]: mean 0, pop. var 0.625
    close(adv, t([[-0.63245553], [0.63245553], [-1.26491106], [1.26491106]]))


@pytest.mark.parametrize("estimator", GROUP)
@pytest.mark.parametrize("whiten_flag", [None, True, False])
def test_constant_group_gives_zero_advantage(estimator, whiten_flag):
    rewards = t([0.7, 0.7, 0.7, -2.0, -2.0, -2.0])
    mask = torch.tensor([[1, 1, 0]] * 6)
    adv, _ = compute_advantages(estimator, rewards, mask, n=3, whiten=whiten_flag)
    assert torch.equal(adv, torch.zeros(6, 3))


@pytest.mark.parametrize("estimator", GROUP)
def test_group_estimators_force_gamma_1_and_warn_once(estimator, monkeypatch):
    monkeypatch.setattr(adv_module, "_warned_gamma", set())
    rewards, mask = t([1.0, 0.0]), torch.ones(2, 3)
    with pytest.warns(UserWarning, match="gamma=0.5 is ignored"):
        adv, _, stats = compute_advantages_with_stats(estimator, rewards, mask, n=2, gamma=0.5)
    assert stats["gamma"] == 1.0
    close(adv, compute_advantages(estimator, rewards, mask, n=2, gamma=1.0)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute_advantages(estimator, rewards, mask, n=2, gamma=0.5)  # second time: silent


def test_reinforce_honours_gamma():
    adv, _ = compute_advantages("reinforce", t([4.0]), torch.ones(1, 3), n=1, gamma=0.5, whiten=False)
    close(adv, t([[1.0, 2.0, 4.0]]))


def test_estimators_tuple_matches_contract():
    assert ESTIMATORS == ("gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo")


def test_padding_does_not_change_advantages():
    rewards, mask = t([1.0, 3.0]), torch.tensor([[1, 1], [1, 0]])
    adv, ret = compute_advantages("reinforce", rewards, mask, n=1)
    mask_p = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    adv_p, ret_p = compute_advantages("reinforce", rewards, mask_p, n=1)
    close(adv_p[:, :2], adv)
    assert torch.equal(adv_p[:, 2:], torch.zeros(2, 2)) and torch.equal(ret_p[:, :2], ret)


def test_skipped_samples_do_not_enter_group_statistics():
    """[1, 1, 1, skipped]: an all-correct group has no gradient (OpenRLHF-style statistics over the
    skipped reward 0 would give [0.5, 0.5, 0.5, -1.5])."""
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    valid = torch.tensor([True, True, True, False, True, True, True, False])
    for est in ("group_norm", "rloo", "reinforce_baseline", "dr_grpo"):
        out = group_baseline(r, 4, est, valid=valid)
        assert out[:4].tolist() == [0.0, 0.0, 0.0, 0.0], est
    # second group: valid rewards [1, 0, 1] (k = 3), the skipped one gets 0
    assert group_baseline(r, 4, "rloo", valid=valid)[4:].tolist() == pytest.approx([0.5, -1.0, 0.5, 0.0])
    mean = 2 / 3
    assert group_baseline(r, 4, "dr_grpo", valid=valid)[4:].tolist() == pytest.approx(
        [1 - mean, -mean, 1 - mean, 0.0])
    std = math.sqrt(((1 - mean) ** 2 * 2 + mean**2) / 2)  # unbiased over the 3 valid samples
    assert group_baseline(r, 4, "group_norm", valid=valid)[4:].tolist() == pytest.approx(
        [(1 - mean) / std, -mean / std, (1 - mean) / std, 0.0], rel=1e-6)


def test_group_with_one_valid_sample_has_zero_advantage():
    r = torch.tensor([3.0, 0.0, 0.0, 0.0])
    valid = torch.tensor([True, False, False, False])
    for est in ("group_norm", "rloo", "reinforce_baseline"):
        assert group_baseline(r, 4, est, valid=valid).tolist() == [0.0] * 4, est
