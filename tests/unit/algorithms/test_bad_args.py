"""Bad arguments raise ValueError naming the argument (and the allowed values where there is a set)."""
import pytest
import torch

from posttrain import algorithms as A

M = torch.ones(2, 3)
Z = torch.zeros(2, 3)
R = torch.zeros(2)


CASES = [
    ("unknown kl estimator", lambda: A.approx_kl(Z, Z, "k4"), r"estimator='k4'.*'k1', 'k2', 'k3'"),
    ("kl clamp", lambda: A.approx_kl(Z, Z, clamp=-1), r"clamp"),
    ("kl shape", lambda: A.approx_kl(Z, torch.zeros(3, 2)), r"ref_logp"),
    ("target", lambda: A.AdaptiveKLController(0.01, 0.0, 10000), r"target"),
    ("horizon", lambda: A.AdaptiveKLController(0.01, 0.1, 0), r"horizon"),
    ("n_steps", lambda: A.AdaptiveKLController(0.01, 0.1, 10).update(0.1, -1), r"n_steps"),
    ("current_kl", lambda: A.AdaptiveKLController(0.01, 0.1, 10).update(float("nan"), 1), r"current_kl"),
    ("fixed coef", lambda: A.FixedKLController(-1), r"coef"),
    ("unknown estimator", lambda: A.compute_advantages("ppo", R, M, n=1), r"estimator='ppo'.*'rloo'"),
    ("baseline estimator", lambda: A.group_baseline(R, 2, "grpo"), r"estimator='grpo'.*'group_norm'"),
    ("n < 1", lambda: A.group_baseline(R, 0, "reinforce"), r"n=0"),
    ("batch % n", lambda: A.compute_advantages("rloo", torch.zeros(3), torch.ones(3, 2), n=2), r"n=2"),
    ("rewards rows", lambda: A.compute_advantages("reinforce", torch.zeros(3), M, n=1), r"rewards"),
    ("gamma", lambda: A.compute_advantages("reinforce", R, M, n=1, gamma=1.5), r"gamma=1.5.*\[0.0, 1.0\]"),
    ("lam", lambda: A.gae(Z, Z, M, 1.0, -0.1), r"lam"),
    ("gamma returns", lambda: A.discounted_returns(Z, M, -0.5), r"gamma"),
    ("gae values", lambda: A.compute_advantages("gae", R, M, n=1), r"values"),
    ("values non-gae", lambda: A.compute_advantages("rloo", R, M, n=2, values=Z), r"values"),
    ("kl needed", lambda: A.compute_advantages("rloo", R, M, n=2, kl_coef=0.1), r"kl"),
    ("kl shape adv", lambda: A.compute_advantages("rloo", R, M, n=2, kl=torch.zeros(2, 2)), r"kl"),
    ("kl_coef", lambda: A.compute_advantages("rloo", R, M, n=2, kl=Z, kl_coef=-1.0), r"kl_coef"),
    ("whiten", lambda: A.compute_advantages("rloo", R, M, n=2, whiten="yes"), r"whiten"),
    ("clip_range", lambda: A.token_rewards(R, None, M, 0.0, clip_range=(1.0, -1.0)), r"clip_range"),
    ("whiten shape", lambda: A.whiten(Z, torch.ones(3, 2)), r"mask"),
    ("agg mode", lambda: A.aggregate(Z, M, "mean"), r"mode='mean'.*'token_mean'"),
    ("agg num_tokens", lambda: A.aggregate(Z, M, num_tokens=-3), r"num_tokens"),
    ("agg max_len", lambda: A.aggregate(Z, M, "seq_sum_norm", max_len=0), r"max_len"),
    ("agg shape", lambda: A.aggregate(Z, torch.ones(3)), r"mask"),
    ("loss_type", lambda: A.policy_loss(Z, Z, Z, M, loss_type="grpo"), r"loss_type='grpo'.*'gspo'"),
    ("policy agg", lambda: A.policy_loss(Z, Z, Z, M, agg="sum"), r"agg='sum'"),
    ("eps_low", lambda: A.policy_loss(Z, Z, Z, M, eps_low=-0.1), r"eps_low"),
    ("eps_high", lambda: A.policy_loss(Z, Z, Z, M, eps_high=-0.1), r"eps_high"),
    ("dual_clip", lambda: A.policy_loss(Z, Z, Z, M, dual_clip=1.0), r"dual_clip"),
    ("is type", lambda: A.policy_loss(Z, Z, Z, M, rollout_logp=Z, is_correction="x"),
     r"is_correction='x'.*'tis'"),
    ("is needs rollout", lambda: A.policy_loss(Z, Z, Z, M, is_correction="tis"), r"rollout_logp"),
    ("is_threshold", lambda: A.policy_loss(Z, Z, Z, M, is_threshold=(5.0, 0.5)), r"is_threshold"),
    ("adv shape", lambda: A.policy_loss(Z, Z, torch.zeros(2, 2), M), r"advantages"),
    ("value clip", lambda: A.value_loss(Z, Z, Z, M, clip=0), r"clip"),
    ("value shape", lambda: A.value_loss(Z, Z, torch.zeros(2), M), r"returns"),
    ("temperature", lambda: A.token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0),
     r"temperature"),
    ("labels shape", lambda: A.token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long)),
     r"labels"),
    ("labels range", lambda: A.token_logprobs(torch.zeros(1, 2, 3), torch.tensor([[0, -100]])), r"labels"),
    ("entropy temperature", lambda: A.entropy(torch.zeros(2, 3), temperature=-1.0), r"temperature"),
    ("buffer_len", lambda: A.overlong_penalty(R, R, 1024, 0), r"buffer_len"),
    ("max_new_tokens", lambda: A.overlong_penalty(R, R, 100, 128), r"max_new_tokens"),
    ("lengths shape", lambda: A.overlong_penalty(R, torch.zeros(3), 1024, 128), r"response_lengths"),
    ("stop coef", lambda: A.stop_properly_penalty(R, R.bool(), 1.5), r"coef"),
    ("filter bounds", lambda: A.dynamic_filter(torch.zeros(2, 2), 1.0, 1.0), r"low"),
    ("filter shape", lambda: A.dynamic_filter(torch.zeros(4), 0.0, 1.0), r"scores"),
    ("beta", lambda: A.dpo_loss(R, R, R, R, beta=0.0), r"beta"),
    ("label_smoothing", lambda: A.dpo_loss(R, R, R, R, label_smoothing=0.7), r"label_smoothing"),
    ("ipo smoothing", lambda: A.dpo_loss(R, R, R, R, label_smoothing=0.1, ipo=True), r"label_smoothing"),
    ("dpo shape", lambda: A.dpo_loss(R, torch.zeros(3), R, R), r"policy_rejected_logps"),
    ("rm loss_type", lambda: A.reward_model_loss(R, R, loss_type="hinge"), r"loss_type='hinge'.*'sigmoid'"),
    ("rm margin logexp", lambda: A.reward_model_loss(R, R, margin=1.0, loss_type="logexp"), r"margin"),
    ("rm shape", lambda: A.reward_model_loss(R, torch.zeros(3)), r"rejected"),
]


@pytest.mark.parametrize("fn, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_argument_raises_value_error_naming_it(fn, pattern):
    with pytest.raises(ValueError, match=pattern):
        fn()
