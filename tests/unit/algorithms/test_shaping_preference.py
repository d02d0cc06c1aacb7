"""Reward shaping and preference losses against hand values (incl. test #9: DPO = log 2 at init)."""
import math

import pytest
import torch

from posttrain.algorithms import (
    dpo_loss,
    dynamic_filter,
    overlong_penalty,
    reward_model_loss,
    stop_properly_penalty,
)

close = torch.testing.assert_close


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_overlong_penalty_check_values():
    # buffer 128, max 1024: L = 896. len 950 -> e = 54 -> r - 54/128 = r - 0.421875.
    # (DAPO's formula e = min(len - L, buffer), as docs/algorithms.md, "Reward shaping": not
    # (1024 - 950) / 128 = 0.578125.)
    r = t([1.0, 1.0, 1.0, 1.0, 1.0])
    lengths = torch.tensor([950, 1024, 896, 500, 960])
    close(overlong_penalty(r, lengths, 1024, 128), t([1 - 0.421875, 0.0, 1.0, 1.0, 0.5]))
    close(overlong_penalty(r, lengths, 1024, 128, factor=2.0), t([1 - 0.84375, -1.0, 1.0, 1.0, 0.0]))


def test_stop_properly_penalty():
    r, trunc = t([1.0, 1.0, 0.5]), torch.tensor([False, True, True])
    close(stop_properly_penalty(r, trunc, 0.5), t([1.0, 0.5, 0.25]))
    close(stop_properly_penalty(r, trunc, 0.0), t([1.0, 0.0, 0.0]))
    close(stop_properly_penalty(r, trunc, -1.0), t([1.0, -1.0, -1.0]))


def test_dynamic_filter_strict_bounds_and_counts():
    scores = t([[0, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]])
    keep = dynamic_filter(scores, 0.0, 1.0)
    assert keep.dtype == torch.bool and keep.tolist() == [False, False, True, True]
    assert int(keep.sum()) == 2 and int((~keep).sum()) == 2
    assert dynamic_filter(scores, -0.1, 1.0).tolist() == [True, False, True, True]


# --- DPO -------------------------------------------------------------------------------------------------
PC, PR, RC, RR = t([-1.0]), t([-2.0]), t([-1.5]), t([-1.5])  # h = 1


def test_dpo_hand_values():
    loss, chosen, rejected = dpo_loss(PC, PR, RC, RR, beta=0.1)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.1)))  # -logσ(0.1) = 0.6443967
    close(chosen, t([0.05]))
    close(rejected, t([-0.05]))
    loss, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.1, label_smoothing=0.1)
    assert loss.item() == pytest.approx(0.9 * 0.6443967 + 0.1 * 0.7443967, abs=1e-6)
    loss, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.1, ipo=True)
    assert loss.item() == pytest.approx((1 - 5) ** 2)


def test_dpo_is_log2_at_initialization_and_rewards_detached():
    logps = torch.tensor([-12.3, -4.0, -30.5])
    pol_c = logps.clone().requires_grad_()
    loss, chosen, _ = dpo_loss(pol_c, logps - 2, logps, logps - 2, beta=0.3)
    assert loss.item() == pytest.approx(math.log(2))
    assert not chosen.requires_grad
    loss.backward()
    close(pol_c.grad, torch.full((3,), -0.3 * 0.5 / 3))  # -β σ(0) / B


def test_reward_model_losses():
    chosen, rejected = t([2.0, 0.0]), t([1.0, 0.0])
    expected = (math.log(1 + math.exp(-1)) + math.log(2)) / 2  # 0.5032044
    assert reward_model_loss(chosen, rejected).item() == pytest.approx(expected)
    assert reward_model_loss(chosen, rejected, loss_type="logexp").item() == pytest.approx(expected)
    assert reward_model_loss(chosen, rejected, margin=t([1.0, 0.0])).item() == pytest.approx(math.log(2))
    assert reward_model_loss(chosen, rejected, margin=1.0).item() == pytest.approx(
        (math.log(2) + math.log(1 + math.e)) / 2)


def test_overlong_penalty_per_sample_budget_and_float_buffer():
    """Each sample's own budget (max_len - its prompt): budgets 100 and 50, buffer 20.0 (a float,
    as the flag parses): length 90 of 100 → excess 10 → -0.5; length 45 of 50 → excess 15 → -0.75."""
    r = torch.tensor([1.0, 1.0])
    out = overlong_penalty(r, torch.tensor([90, 45]), torch.tensor([100, 50]), 20.0)
    assert out.tolist() == pytest.approx([0.5, 0.25])
    with pytest.raises(ValueError, match="max_new_tokens=10 must be >= buffer_len=20"):
        overlong_penalty(r, torch.tensor([5, 5]), torch.tensor([100, 10]), 20)


def test_step_scores_are_normalised_over_the_steps_of_each_prompt():
    """DeepSeekMath process supervision: (r - mean) / std over all steps of a prompt's samples, unbiased std.
    Prompt 0's steps 0.2 0.4 0.9: mean 0.5, var (0.09 + 0.01 + 0.16) / 2 = 0.13; prompt 1's 0.5 0.7: mean
    0.6, var 0.02; prompt 2 has one step: 0. The steps of a prompt need not be adjacent."""
    from posttrain.algorithms.shaping import normalize_step_scores

    scores = t([0.2, 0.5, 0.4, 0.9, 0.3, 0.7])
    groups = torch.tensor([0, 1, 0, 0, 2, 1])
    s013, s002 = math.sqrt(0.13), math.sqrt(0.02)
    want = [-0.3 / s013, -0.1 / s002, -0.1 / s013, 0.4 / s013, 0.0, 0.1 / s002]
    close(normalize_step_scores(scores, groups, eps=0.0), t(want))
    close(normalize_step_scores(scores, groups), t(want), atol=1e-6, rtol=0)  # eps 1e-9 by default
    # centring only (rloo, reinforce_baseline, dr_grpo): r - mean, still 0 for a prompt of one step
    close(normalize_step_scores(scores, groups, scale=False), t([-0.3, -0.1, -0.1, 0.4, 0.0, 0.1]))
    assert normalize_step_scores(t([]), torch.tensor([], dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="groups"):
        normalize_step_scores(scores, groups[:2])
