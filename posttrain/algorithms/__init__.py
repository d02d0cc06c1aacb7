"""posttrain.algorithms: the pure tensor math of post-training (see docs/algorithms.md).

Imports torch only. Every choice by name (advantage estimator, policy-loss type, aggregation
mode, KL estimator, IS correction, reward-model loss) is a key of one registry dict.
"""
from ._util import masked_mean
from .advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS,
    WHITEN_LEVELS,
    compute_advantages,
    compute_advantages_with_stats,
    discounted_returns,
    gae,
    group_baseline,
    token_rewards,
    token_rewards_with_stats,
    whiten,
    whiten_sequences,
)
from .distillation import KD_LOSSES, distillation_loss, generalized_jsd, kd_divergence
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, approx_kl, approx_kl_with_stats
from .losses import (
    AGGREGATIONS,
    IS_CORRECTIONS,
    POLICY_LOSSES,
    aggregate,
    entropy,
    gathered_logprobs,
    policy_loss,
    token_logprobs,
    value_loss,
    value_loss_with_stats,
)
from .preference import RM_LOSSES, cpo_loss, dpo_loss, orpo_loss, reward_model_loss, simpo_loss
from .process_reward import placeholder_logits, prm_correct, prm_loss, render_steps, step_scores
from .shaping import (
    batch_normalize_scores,
    dynamic_filter,
    missing_eos_penalty,
    overlong_penalty,
    stop_properly_penalty,
    teacher_token_rewards,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "AdaptiveKLController", "ESTIMATORS", "FixedKLController",
    "IS_CORRECTIONS", "KD_LOSSES", "KL_ESTIMATORS", "POLICY_LOSSES", "RM_LOSSES", "WHITEN_LEVELS",
    "aggregate", "approx_kl", "approx_kl_with_stats", "batch_normalize_scores", "compute_advantages",
    "compute_advantages_with_stats", "cpo_loss", "discounted_returns", "distillation_loss", "dpo_loss",
    "dynamic_filter", "entropy", "gae", "gathered_logprobs", "generalized_jsd", "group_baseline",
    "kd_divergence", "masked_mean", "missing_eos_penalty", "orpo_loss", "overlong_penalty",
    "placeholder_logits", "policy_loss", "prm_correct", "prm_loss", "render_steps", "reward_model_loss",
    "simpo_loss", "step_scores", "stop_properly_penalty", "teacher_token_rewards", "token_logprobs",
    "token_rewards", "token_rewards_with_stats", "value_loss", "value_loss_with_stats", "whiten",
    "whiten_sequences",
]
