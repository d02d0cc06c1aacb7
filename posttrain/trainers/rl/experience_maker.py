"""From scored rollouts to training experience: old / reference log-probs, values, KL, rewards →
advantages and returns (docs/algorithms.md), plus the rollout statistics the loop logs. Calls only role
methods (`logprobs`, `values`), so it is the same for both placements."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from posttrain.algorithms import masked_mean
from posttrain.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages_with_stats, whiten
from posttrain.algorithms.kl import approx_kl_with_stats
from posttrain.algorithms.shaping import batch_normalize_scores, normalize_step_scores, teacher_token_rewards
from posttrain.trainers.rl.batch_forward import Batching
from posttrain.trainers.rl.experience import Experience, build_experience
from posttrain.trainers.rl.updates import steps_per_rollout

if TYPE_CHECKING:
    from posttrain.config import PPOConfig


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over the sequences with any masked token of each one's token mean (OpenRLHF's KL
    statistic, which also feeds the adaptive controller)."""
    tokens = mask.sum(1)
    has = tokens > 0
    if not bool(has.any()):
        return 0.0
    return float(((x * mask).sum(1)[has] / tokens[has]).mean())


def _scalar(v) -> bool:
    return isinstance(v, (int, float, bool)) or (isinstance(v, torch.Tensor) and v.numel() == 1)


class ExperienceMaker:
    """`make(scored, kl_coef)` → (Experience, metrics) with the run's roles (`ref`, `critic`, `teacher`, `prm`
    may be None); the actor and critic forward in `batching`, the reference and the teacher (frozen, like it)
    in `ref_batching` (default `batching`). `prm`: a process reward model (`score_steps`: in this process or
    its Ray group)."""

    def __init__(self, cfg: PPOConfig, actor, ref, critic, batching: Batching, pad_id: int,
                 ref_batching: Batching | None = None, teacher=None, prm=None) -> None:
        self.cfg, self.actor, self.ref, self.critic, self.teacher = cfg, actor, ref, critic, teacher
        self.prm = prm
        self.batching, self.pad_id = batching, pad_id
        self.ref_batching = ref_batching or batching

    def needs_old_logp(self, num_samples: int) -> bool:
        """With exactly one optimizer step per rollout and no KL penalty in the reward, the policy that
        is trained is the one that sampled, so the old log-probs equal the training forward's (ratio 1):
        the update takes them from there instead of a separate forward pass (as TRL does)."""
        cfg = self.cfg
        one_step = steps_per_rollout(num_samples, cfg.train.batch_size, cfg.train.max_epochs) == 1
        kl_in_reward = self.ref is not None and not cfg.algo.kl.use_loss
        return not one_step or kl_in_reward or self.teacher is not None

    def make(self, scored, kl_coef: float) -> tuple[Experience, dict[str, float]]:
        cfg = self.cfg
        mbs = self.batching
        rewards = scored.rewards.clone()  # shaped (`collect.shape_rewards`)
        valid = ~scored.skipped  # statistics over the samples that have a reward
        if cfg.reward.batch_normalize_enable:  # TRL normalize_reward + reward_clip_range
            rewards = batch_normalize_scores(rewards, cfg.reward.batch_normalize_clip, valid=valid)
        if cfg.reward.whiten_enable:  # whiten the scalar rewards before the baseline
            rewards = whiten(rewards[:, None], valid.float()[:, None])[:, 0]
        exp = build_experience(scored.rollouts, rewards, self.pad_id)
        # samples without a reward train nothing (counted in reward/skipped)
        exp.action_mask[scored.skipped] = 0.0
        mask = exp.action_mask
        metrics: dict[str, float] = {}
        if self.needs_old_logp(len(scored.rollouts)):
            exp.old_logp = self.actor.logprobs(exp, mbs)
            metrics["rollout/logprob_abs_gap"] = masked_mean((exp.old_logp - exp.rollout_logp).abs(),
                                                             mask).item()
        kl = None
        if self.ref is not None:
            exp.ref_logp = self.ref.logprobs(exp, self.ref_batching)
        if exp.ref_logp is not None and exp.old_logp is not None:
            kl, kl_stats = approx_kl_with_stats(exp.old_logp, exp.ref_logp, cfg.algo.kl.estimator,
                                                 clamp=cfg.algo.kl.clamp or None, mask=mask)
            kl = kl * mask
            metrics.update({"kl/mean": sequence_mean(kl, mask),
                            "kl/clamp_frac": float(kl_stats["kl_clamp_frac"])})
        token_extra = _added(self._teacher_term(exp, metrics), self._prm_term(scored, exp, metrics))
        if self.critic is not None:
            exp.values = self.critic.values(exp, mbs)
        in_reward = kl is not None and not cfg.algo.kl.use_loss
        adv = cfg.algo.advantage
        exp.advantages, exp.returns, stats = compute_advantages_with_stats(
            adv.estimator, exp.rewards, mask, n=cfg.rollout.n_samples_per_prompt,
            kl=kl if in_reward else None, kl_coef=kl_coef if in_reward else 0.0, values=exp.values,
            gamma=adv.gamma, lam=adv.lambd, clip_range=tuple(cfg.reward.clip_range),
            std_norm=not adv.no_std_norm, sequence_kl=cfg.algo.kl.sequence_level_enable,
            whiten=True if adv.whiten_enable else None,
            whiten_level=adv.whiten_level if adv.whiten_enable else "token", valid=valid, std_eps=adv.std_eps,
            token_extra=token_extra)
        metrics.update({f"advantage/{k}": float(v) for k, v in stats.items() if _scalar(v)})
        metrics["advantage/mean"] = masked_mean(exp.advantages, mask).item()
        return exp, metrics

    def _teacher_term(self, exp: Experience, metrics: dict) -> torch.Tensor | None:
        """On-policy distillation: the teacher scores every sampled token, and `-c · (old - teacher)` per
        action token (`algorithms.shaping.teacher_token_rewards`, c = --algo.teacher_coef) joins the per-token
        rewards; logs `teacher/reverse_kl`, the token mean of `old - teacher`. None without a teacher."""
        if self.teacher is None:
            return None
        mask = exp.action_mask
        teacher_logp = self.teacher.logprobs(exp, self.ref_batching)
        metrics["teacher/reverse_kl"] = masked_mean(exp.old_logp - teacher_logp, mask).item()
        coef = self.cfg.algo.teacher_coef
        return teacher_token_rewards(exp.old_logp, teacher_logp, mask, 1.0 if coef is None else coef)

    def _prm_term(self, scored, exp: Experience, metrics: dict) -> torch.Tensor | None:
        """Process rewards: each scored step's score on the action column of its last token (`StepRewards`),
        x --reward.model_weight, 0 elsewhere ``[B, T-1]``; under a group estimator the scores are first
        normalised over all the steps of a prompt's n samples (`normalize_step_scores`: group_norm divides
        by their std + --algo.advantage.std_eps, rloo / reinforce_baseline / dr_grpo only centre). A skipped
        sample's steps count nowhere. Logs `reward/prm` (mean raw step score), `reward/prm_steps` (mean steps
        per response) and `reward/prm_dropped_steps` (steps with no score: cut off the PRM's input, or their
        placeholder merged). None without a PRM."""
        if self.prm is None:
            return None
        rollouts = scored.rollouts
        steps = self.prm.score_steps([r.prompt_ids for r in rollouts], [r.output_ids for r in rollouts])
        n = self.cfg.rollout.n_samples_per_prompt
        rows, cols, groups, scores = [], [], [], []
        kept = [i for i in range(len(rollouts)) if not scored.skipped[i]]
        for i in kept:
            start = len(rollouts[i].prompt_ids) - 1  # the action column of output token 0
            for end, score in zip(steps.ends[i], steps.scores[i]):
                rows.append(i)
                cols.append(start + end)
                groups.append(i // n)
                scores.append(score)
        values = torch.tensor(scores, dtype=torch.float32)
        metrics["reward/prm"] = float(values.mean()) if scores else 0.0
        metrics["reward/prm_steps"] = sum(steps.steps[i] for i in kept) / max(len(kept), 1)
        metrics["reward/prm_dropped_steps"] = float(sum(steps.dropped[i] for i in kept))
        adv = self.cfg.algo.advantage
        if ADVANTAGE_ESTIMATORS[adv.estimator].group:  # group_norm's std and eps; the others centre only
            values = normalize_step_scores(values, torch.tensor(groups, dtype=torch.long),
                                           eps=1e-9 if adv.std_eps is None else adv.std_eps,
                                           scale=adv.estimator == "group_norm")
        term = torch.zeros_like(exp.action_mask)
        at = (torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long))
        term.index_put_(at, values * self.cfg.reward.model_weight, accumulate=True)  # steps may share a token
        return term


def _added(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b, either None meaning absent."""
    return b if a is None else a if b is None else a + b


def rollout_metrics(scored, n: int) -> dict[str, float]:
    """Reward/score statistics, response lengths, truncation, zero-variance groups, skips."""
    r = scored.rewards
    valid = ~scored.skipped
    lengths = torch.tensor([len(x.output_ids) for x in scored.rollouts], dtype=torch.float32)
    rv = r[valid] if bool(valid.any()) else r  # statistics of the samples that have a reward
    out = {"reward/mean": float(rv.mean()), "reward/std": float(rv.std(unbiased=False)),
           "score/mean": float(scored.scores.mean()), "score/std": float(scored.scores.std(unbiased=False)),
           "response/length": float(lengths.mean()), "response/length_max": float(lengths.max()),
           "response/truncated_frac": sum(x.finish_reason == "length"
                                          for x in scored.rollouts) / len(scored.rollouts),
           "reward/skipped": float(scored.skipped.sum())}
    if n > 1:  # spread of the valid rewards of each group (a skipped sample has no reward)
        groups, ok = r.view(-1, n), valid.view(-1, n)
        spread = torch.where(ok, groups, -math.inf).amax(1) - torch.where(ok, groups, math.inf).amin(1)
        out["reward/zero_std_group_frac"] = float(((spread == 0) | (ok.sum(1) < 2)).float().mean())
    for k, v in scored.extra_logs.items():
        t = torch.as_tensor(v, dtype=torch.float32)
        out[f"reward/{k}"] = float(t.nanmean())  # an agent's extra log may be missing for some episodes
    out.update(agent_metrics(scored.rollouts))
    return out


def agent_metrics(rollouts) -> dict[str, float]:
    """Multi-turn episodes (`Rollout.turns` > 0 or failed): turns per episode (mean, max), environment
    tokens per episode, seconds per environment step, failed episodes, and the malformed tool calls of the
    episodes that offered tools (when any did); {} for single-turn batches."""
    episodes = [r for r in rollouts if r.turns > 0]
    failed = sum(r.error is not None for r in rollouts)
    if not episodes and not failed:
        return {}
    out = {"agent/failed": float(failed)}
    if episodes:
        turns = torch.tensor([r.turns for r in episodes], dtype=torch.float32)
        out.update({"agent/turns_mean": float(turns.mean()), "agent/turns_max": float(turns.max()),
                    "agent/env_tokens": sum(r.env_tokens for r in episodes) / len(episodes),
                    "agent/step_time": sum(r.step_time for r in episodes) / float(turns.sum())})
    tool_errors = [r.tool_call_errors for r in episodes if r.tool_call_errors is not None]
    if tool_errors:
        out["agent/tool_call_errors"] = float(sum(tool_errors))
    return out

