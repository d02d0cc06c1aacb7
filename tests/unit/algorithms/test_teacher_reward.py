"""On-policy distillation's per-token reward (`teacher_token_rewards`) and where it lands among the per-token
rewards (`compute_advantages(..., token_extra=)`), hand-computed on tiny tensors."""
import pytest
import torch

from posttrain.algorithms import compute_advantages, teacher_token_rewards


def close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected), rtol=0, atol=1e-6)


def test_the_term_is_minus_coef_times_the_sampled_log_ratio_on_action_tokens_only():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    teacher = torch.tensor([[-1.5, -1.0, -4.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    # -2 * (logp - teacher) = -2 * [0.5, -1, 3.5, -2.9] = [-1, 2, (-7, masked), 5.8]
    out = teacher_token_rewards(logp, teacher, mask, 2.0)
    close(out, [[-1.0, 2.0, 0.0, 5.8]])
    assert teacher_token_rewards(logp, logp, mask, 3.0).abs().sum() == 0  # the teacher is the policy
    with pytest.raises(ValueError, match="coef"):
        teacher_token_rewards(logp, teacher, mask, -1.0)


def test_the_teacher_term_joins_the_task_reward_and_the_kl_penalty_per_token():
    # two samples of one prompt, three action columns; sample 1 ends one token early
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    extra = torch.tensor([[-1.0, 0.5, 2.0], [0.25, -0.5, 9.0]])  # column 2 of sample 1 is not an action
    # reinforce, gamma 0: the advantage of a token is its own reward (no whitening asked: whiten=False)
    adv, _ = compute_advantages("reinforce", rewards, mask, n=2, kl=kl, kl_coef=0.5, gamma=0.0, whiten=False,
                                token_extra=extra)
    expected = [[-0.05 - 1.0, -0.1 + 0.5, 1.0 - 0.15 + 2.0],  # task reward on the last action token
                [-0.2 + 0.25, 0.0 - 0.25 - 0.5, 0.0]]
    close(adv, expected)
    # rloo (gamma 1): the group baseline takes the task rewards only (1 - 0 and 0 - 1); the per-token terms
    # are summed from each token to the end, as the KL penalty's are
    adv, _ = compute_advantages("rloo", rewards, mask, n=2, kl=kl, kl_coef=0.5, token_extra=extra)
    tok0 = [-1.05, 0.4, 1.0 + 1.85]
    tok1 = [0.05, -1.0 - 0.75, 0.0]
    close(adv, [[sum(tok0), sum(tok0[1:]), tok0[2]], [sum(tok1), tok1[1], 0.0]])


def test_the_teacher_term_alone_is_untouched_by_the_group_baselines():
    """No reward source: every task reward is 0, so every group baseline is 0 and each estimator that does
    not whiten sees the teacher's per-token rewards alone."""
    mask = torch.ones(2, 2)
    extra = torch.tensor([[1.0, -2.0], [0.5, 0.5]])
    for estimator in ("rloo", "group_norm", "dr_grpo"):
        adv, _ = compute_advantages(estimator, torch.zeros(2), mask, n=2, token_extra=extra)
        close(adv, [[-1.0, -2.0], [1.0, 0.5]])


def test_gae_takes_the_teacher_term_as_per_token_rewards_beside_the_critics_values():
    """gae (a critic): r_t = extra_t (+ the task reward on the last token); A_t = G_t - V_t with lambda 1,
    G_t the discounted return; the returns the critic learns are A_t + V_t."""
    mask = torch.ones(1, 3)
    extra = torch.tensor([[0.5, -1.0, 2.0]])
    values = torch.tensor([[0.2, 0.3, 0.4]])
    # gamma 1: rewards [0.5, -1, 2 + 1]; returns [2.5, 2, 3]; advantages returns - values
    adv, ret = compute_advantages("gae", torch.tensor([1.0]), mask, n=1, values=values, gamma=1.0, lam=1.0,
                                  whiten=False, token_extra=extra)
    close(adv, [[2.3, 1.7, 2.6]])
    close(ret, [[2.5, 2.0, 3.0]])
    # gamma 0.5: G = [0.5 + 0.5 * 0.5, -1 + 0.5 * 3, 3] = [0.75, 0.5, 3]
    adv, ret = compute_advantages("gae", torch.tensor([1.0]), mask, n=1, values=values, gamma=0.5, lam=1.0,
                                  whiten=False, token_extra=extra)
    close(adv, [[0.55, 0.2, 2.6]])
    close(ret, [[0.75, 0.5, 3.0]])


def test_reinforce_baseline_subtracts_the_group_mean_from_the_task_reward_only():
    """reinforce_baseline: the task rewards [1, 0] of one prompt's two samples become [0.5, -0.5]; the teacher
    term is added per token afterwards, and the returns (gamma 1) sum it to the end; its default whitening is
    a separate step (whiten=False here)."""
    mask = torch.ones(2, 2)
    extra = torch.tensor([[1.0, -2.0], [0.5, 0.5]])
    adv, _ = compute_advantages("reinforce_baseline", torch.tensor([1.0, 0.0]), mask, n=2, whiten=False,
                                token_extra=extra)
    # rewards per token: [1, -2 + 0.5] and [0.5, 0.5 - 0.5]
    close(adv, [[-0.5, -1.5], [0.5, 0.0]])
