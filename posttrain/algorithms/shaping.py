"""Reward shaping applied to scalar rewards before advantage estimation, the per-token on-policy
distillation reward, the group normalisation of process-reward step scores, and DAPO dynamic filtering."""
from __future__ import annotations

import math

import torch

from ._util import bool_mask, check_ndim, check_shape, f32


def _finite(name, value, low=None) -> float:
    """``value`` as a finite float (and ``>= low`` when given), else ValueError naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (low is not None and value < low):
        raise ValueError(f"{name}={value!r} must be a finite number" + ("" if low is None else f" >= {low}"))
    return float(value)


def overlong_penalty(rewards, response_lengths, max_new_tokens, buffer_len, factor=1.0):
    """DAPO soft overlong punishment. ``L = max_new_tokens - buffer_len``,
    ``e = min(len - L, buffer_len)``; where ``e > 0``: ``r - e / buffer_len * factor``.
    (buffer 128, max 1024: len 896 → r, len 960 → r - 0.5, len ≥ 1024 → r - factor.)
    ``max_new_tokens`` is one budget for all samples or each sample's own budget ``[B]`` (with
    ``--rollout.max_new_tokens`` unset a sample may generate ``max_len - len(its prompt)`` tokens);
    ``buffer_len`` is a number > 0 (OpenRLHF's flag is a float) and no budget may be below it.
    The number penalised is ``(response_lengths > max_new_tokens - buffer_len).sum()``."""
    check_ndim("rewards", rewards, 1, "[B]")
    check_shape("response_lengths", response_lengths, "rewards", rewards)
    if not isinstance(buffer_len, (int, float)) or isinstance(buffer_len, bool) or not buffer_len > 0:
        raise ValueError(f"buffer_len={buffer_len!r} must be a number > 0")
    budget = torch.as_tensor(max_new_tokens, dtype=torch.float32, device=f32(rewards).device)
    if budget.dim() == 1:
        check_shape("max_new_tokens", budget, "rewards", rewards)
    elif budget.dim() != 0:
        raise ValueError(f"max_new_tokens must be a number or a [B] tensor, got shape {tuple(budget.shape)}")
    if bool((budget < buffer_len).any()):
        raise ValueError(f"max_new_tokens={float(budget.min()):g} must be >= buffer_len={buffer_len}")
    if not isinstance(factor, (int, float)) or factor < 0:
        raise ValueError(f"factor={factor!r} must be a number >= 0")
    expected = budget - buffer_len
    excess = (f32(response_lengths) - expected).clamp(min=0.0, max=float(buffer_len))
    return f32(rewards) - excess / buffer_len * factor


def stop_properly_penalty(rewards, truncated, coef):
    """ProRL penalty for truncated samples (finish_reason == "length"): ``coef ∈ [0, 1]`` → ``r·coef``;
    ``coef < 0`` → ``r = coef``. Other samples unchanged."""
    check_ndim("rewards", rewards, 1, "[B]")
    check_shape("truncated", truncated, "rewards", rewards)
    if not isinstance(coef, (int, float)) or coef > 1:
        raise ValueError(f"coef={coef!r} must be a number in [0, 1] (scale) or < 0 (replace)")
    r = f32(rewards)
    shaped = r * coef if coef >= 0 else torch.full_like(r, float(coef))
    return torch.where(truncated.bool(), shaped, r)


def missing_eos_penalty(scores, has_eos, penalty):
    """TRL ``missing_eos_penalty``: ``s - penalty`` for every sample whose response contains no EOS
    token (``has_eos`` False), other samples unchanged. ``penalty`` is subtracted (a positive value
    penalises; TRL applies it to the raw scores before any normalisation). ``[B]`` float32.
    (scores [1, 2.5], has_eos [True, False], penalty 1 → [1, 1.5].)"""
    check_ndim("scores", scores, 1, "[B]")
    check_shape("has_eos", has_eos, "scores", scores)
    penalty = _finite("penalty", penalty)
    s = f32(scores)
    return torch.where(bool_mask(has_eos), s, s - penalty)


def batch_normalize_scores(scores, clip, valid=None, eps=1e-8):
    """TRL ``normalize_reward`` with ``reward_clip_range``: over the valid samples of the batch,
    ``clamp((s - mean(s)) / (std(s) + eps), -clip, clip)`` with the **unbiased** std (``n - 1``);
    ``clip=None``: no clamp. ``valid`` (bool ``[B]``, default all True): statistics over the valid
    samples only; invalid samples get 0. With fewer than two valid samples the std is taken as 0
    (a single sample becomes 0). ``[B]`` float32. ([1, 2, 3] → [-1, 0, 1]: mean 2, std 1.)"""
    check_ndim("scores", scores, 1, "[B]")
    if clip is not None:
        clip = _finite("clip", clip, low=0.0)
    s = f32(scores)
    if valid is None:
        ok = torch.ones_like(s, dtype=torch.bool)
    else:
        check_shape("valid", valid, "scores", scores)
        ok = bool_mask(valid)
    k = ok.sum().to(s.dtype)
    mean = torch.where(ok, s, 0.0).sum() / k.clamp(min=1)
    centred = s - mean
    var = torch.where(ok, centred * centred, 0.0).sum() / (k - 1).clamp(min=1)
    out = centred / (var.sqrt() + eps)
    if clip is not None:
        out = out.clamp(-clip, clip)
    return torch.where(ok, out, 0.0)


def teacher_token_rewards(logp, teacher_logp, mask, coef):
    """On-policy distillation's per-token reward ``[B, A]``: ``-coef · (logp_t - teacher_logp_t)`` on the
    masked (sampled) tokens, 0 elsewhere; ``logp`` are the log-probs of the sampled tokens under the policy
    that sampled them, ``teacher_logp`` under the teacher, so ``logp - teacher_logp`` is the one-sample
    estimate of the reverse KL ``KL(π || π_teacher)`` at that token (Thinking Machines' on-policy
    distillation; TRL GKD with lmbda 1 and beta 1 minimises the same divergence exactly, over the whole
    vocabulary). ``coef >= 0``. (logp [-1, -2], teacher [-1.5, -1], mask [1, 1], coef 2 → [-1, 2].)"""
    check_ndim("mask", mask, 2, "[B, A]")
    check_shape("logp", logp, "mask", mask)
    check_shape("teacher_logp", teacher_logp, "mask", mask)
    coef = _finite("coef", coef, low=0.0)
    return torch.where(bool_mask(mask), -coef * (f32(logp) - f32(teacher_logp)), 0.0)


def normalize_step_scores(scores, groups, eps=1e-9, scale=True):
    """DeepSeekMath §4.1.3 process supervision: each step score ``r`` becomes ``(r - mean) / (std + eps)``,
    mean and **unbiased** std (``k - 1``; as ``group_norm``) over the ``k`` steps of its group (all the steps
    of a prompt's n samples); a group of one step gets 0. ``scale=False``: ``r - mean`` (centring only, as
    the mean-baseline estimators: dr_grpo drops the std). ``scores`` ``[S]`` (any order), ``groups`` ``[S]``
    int (the prompt of each step). ``[S]`` float32.
    (scores [1, 2, 3, 5], groups [0, 0, 0, 1] → [-1, 0, 1, 0]: group 0 has mean 2, std 1.)"""
    check_ndim("scores", scores, 1, "[S]")
    check_shape("groups", groups, "scores", scores)
    eps = _finite("eps", eps, low=0.0)
    s = f32(scores)
    if s.numel() == 0:
        return s
    _, index = torch.unique(groups, return_inverse=True)
    size = int(index.max()) + 1
    k = torch.zeros(size, dtype=s.dtype, device=s.device).index_add_(0, index, torch.ones_like(s))
    mean = torch.zeros_like(k).index_add_(0, index, s) / k
    centred = s - mean[index]
    var = torch.zeros_like(k).index_add_(0, index, centred * centred) / (k - 1).clamp(min=1)
    return torch.where(k[index] >= 2, centred / (var.sqrt()[index] + eps) if scale else centred, 0.0)


def dynamic_filter(scores, low, high, valid=None):
    """DAPO dynamic sampling: keep prompt ``p`` iff ``low < mean_j scores[p, j] < high`` (strict).
    ``scores`` is ``[num_prompts, n]``; returns a bool ``[num_prompts]`` (kept = ``.sum()``,
    dropped = ``(~keep).sum()``). ``valid`` (bool, same shape) **[beyond]**: the mean runs over
    valid samples only (a skipped sample's placeholder score must not decide); a group without
    any valid sample is dropped."""
    check_ndim("scores", scores, 2, "[num_prompts, n]")
    if not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and low < high):
        raise ValueError(f"low={low!r}, high={high!r}: need numbers with low < high")
    s = f32(scores)
    if valid is None:
        mean = s.mean(dim=1)
        return (mean > low) & (mean < high)
    check_shape("valid", valid, "scores", scores)
    ok = valid.bool()
    k = ok.sum(dim=1)
    mean = torch.where(ok, s, 0.0).sum(dim=1) / k.clamp(min=1)
    return (k > 0) & (mean > low) & (mean < high)
