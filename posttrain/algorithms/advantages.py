"""Advantage estimation: group baselines, token rewards, returns / GAE and whitening.

Rewards are laid out group-contiguous: the ``n`` samples of prompt ``p`` are rows ``p*n .. p*n+n-1``.
``compute_advantages`` runs the whole pipeline of docs/algorithms.md ("Advantage estimators") in order:
(sequence-level KL) → group baseline → token rewards → returns / GAE → whitening.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._util import (
    bool_mask,
    check_choice,
    check_interval,
    check_ndim,
    check_pair,
    check_shape,
    f32,
    masked_mean,
    masked_sum,
)


def _unchanged(r: torch.Tensor, valid: torch.Tensor, eps: float) -> torch.Tensor:
    return r


def _group_stats(r: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, Σ r, mean) over the valid samples of each group, each ``[num_prompts, 1]``."""
    k = valid.sum(1, keepdim=True).to(r.dtype)
    total = torch.where(valid, r, 0.0).sum(1, keepdim=True)
    return k, total, total / k.clamp(min=1)


def _rloo(r: torch.Tensor, valid: torch.Tensor, eps: float) -> torch.Tensor:
    """r_i - (Σ_j r_j - r_i) / (k - 1) over the k valid samples of the group (0 when k < 2)."""
    k, total, _ = _group_stats(r, valid)
    out = r - (total - r) / (k - 1).clamp(min=1)
    return torch.where(k >= 2, out, 0.0)


def _mean_baseline(r: torch.Tensor, valid: torch.Tensor, eps: float) -> torch.Tensor:
    """r_i - mean_j r_j over the valid samples."""
    return r - _group_stats(r, valid)[2]


def _group_norm(r: torch.Tensor, valid: torch.Tensor, eps: float) -> torch.Tensor:
    """(r_i - mean_j r_j) / (std_j r_j + eps) over the k valid samples, unbiased std (0 when k < 2)."""
    k, _, mean = _group_stats(r, valid)
    centred = r - mean
    var = torch.where(valid, centred * centred, 0.0).sum(1, keepdim=True) / (k - 1).clamp(min=1)
    return torch.where(k >= 2, centred / (var.sqrt() + eps), 0.0)


@dataclass(frozen=True)
class Estimator:
    baseline: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (r, valid, eps), [num_prompts, n]
    group: bool  # needs n >= 2 samples per prompt; forces gamma = 1
    whiten: bool  # whitened by default (whiten=None)
    uses_values: bool = False  # GAE on a critic's values


ADVANTAGE_ESTIMATORS = {
    "gae": Estimator(_unchanged, group=False, whiten=True, uses_values=True),
    "reinforce": Estimator(_unchanged, group=False, whiten=True),
    "reinforce_baseline": Estimator(_mean_baseline, group=True, whiten=True),
    "rloo": Estimator(_rloo, group=True, whiten=False),
    "group_norm": Estimator(_group_norm, group=True, whiten=False),
    "dr_grpo": Estimator(_mean_baseline, group=True, whiten=False),
}
ESTIMATORS = tuple(ADVANTAGE_ESTIMATORS)

_warned_gamma: set[str] = set()  # estimators already warned about gamma being forced to 1


def _check_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} (samples per prompt) must be an int >= 1")
    return n


def group_baseline(rewards, n, estimator, eps=1e-9, valid=None):
    """Apply the estimator's group baseline to scalar rewards ``[B]`` (float32):

    rloo ``r_i - (Σ_j r_j - r_i)/(n-1)``; reinforce_baseline, dr_grpo ``r_i - mean_j r_j``;
    group_norm ``(r_i - mean_j r_j)/(std_j r_j + eps)`` (unbiased std); gae, reinforce unchanged.
    Group estimators need ``n >= 2`` and ``B`` divisible by ``n``.

    ``valid`` (bool ``[B]``, default all True) **[beyond]**: group statistics run over the valid
    samples only (a sample whose reward could not be computed must not shift its group), with
    ``k`` = the group's valid count in place of ``n``; invalid samples, and groups with fewer than
    two valid samples under rloo / group_norm, get 0."""
    check_choice("estimator", estimator, ADVANTAGE_ESTIMATORS)
    check_ndim("rewards", rewards, 1, "[B]")
    n = _check_n(n)
    spec = ADVANTAGE_ESTIMATORS[estimator]
    r = f32(rewards)
    if valid is None:
        valid = torch.ones_like(r, dtype=torch.bool)
    else:
        check_shape("valid", valid, "rewards", rewards)
        valid = bool_mask(valid)
    if not spec.group:
        return torch.where(valid, r, 0.0)
    if n < 2:
        raise ValueError(
            f"n={n}: estimator {estimator!r} needs n >= 2 samples per prompt "
            f"(--rollout.n_samples_per_prompt); use 'reinforce' or 'gae' for n = 1"
        )
    if r.shape[0] % n != 0:
        raise ValueError(f"rewards has {r.shape[0]} rows, not divisible by n={n} (group-contiguous layout)")
    groups, ok = r.view(-1, n), valid.view(-1, n)
    # Every group baseline is shift-invariant; shifting by the group's first valid reward makes a
    # constant group exactly zero and avoids cancellation with large reward offsets.
    first = groups.gather(1, ok.to(torch.uint8).argmax(1, keepdim=True))
    out = spec.baseline(groups - first, ok, eps)
    return torch.where(ok, out, 0.0).reshape(-1)


def _last_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last set position per row, and whether the row has any."""
    m = bool_mask(mask)
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    last = torch.where(m, pos, -1).max(dim=1).values
    return last.clamp(min=0), last >= 0


def token_rewards_with_stats(rewards, kl, mask, kl_coef, clip_range=(-10.0, 10.0), extra=None):
    """``token_rewards`` plus stats: ``reward_clip_count`` (rewards clamped by clip_range) and
    ``empty_rows`` (rows without a masked position, whose reward could not be placed)."""
    check_ndim("mask", mask, 2, "[B, A]")
    check_ndim("rewards", rewards, 1, "[B]")
    if rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} rows but mask has {mask.shape[0]}")
    if kl is not None:
        check_shape("kl", kl, "mask", mask)
    elif kl_coef != 0:
        raise ValueError(f"kl is None but kl_coef={kl_coef}; pass kl or set kl_coef=0")
    r = f32(rewards)
    clip_count = torch.zeros((), dtype=torch.long, device=r.device)
    if clip_range is not None:
        lo, hi = check_pair("clip_range", clip_range)
        clip_count = ((r < lo) | (r > hi)).sum()
        r = r.clamp(lo, hi)
    last, has_any = _last_index(mask)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=r.device)
    out = out.scatter(1, last[:, None], torch.where(has_any, r, 0.0)[:, None])
    if kl is not None and kl_coef != 0:
        out = out - kl_coef * torch.where(bool_mask(mask), f32(kl), 0.0)
    if extra is not None:
        check_shape("extra", extra, "mask", mask)
        out = out + torch.where(bool_mask(mask), f32(extra), 0.0)
    stats = {"reward_clip_count": clip_count, "empty_rows": (~has_any).sum()}
    return out, stats


def token_rewards(rewards, kl, mask, kl_coef, clip_range=(-10.0, 10.0), extra=None):
    """Per-token rewards ``[B, A]``: ``clamp(r, *clip_range)`` on the last masked position of each
    row, plus ``-kl_coef * kl`` on every masked position (``kl`` may be None when kl_coef == 0), plus
    ``extra[B, A]`` (per-token reward terms such as on-policy distillation's, unclipped) on every masked
    position. ``token_rewards_with_stats`` also reports how many rewards were clipped."""
    return token_rewards_with_stats(rewards, kl, mask, kl_coef, clip_range, extra)[0]


def discounted_returns(token_rewards, mask, gamma):
    """``G_t = Σ_{k≥t} γ^{k-t} m_k R_k`` (discount by position distance), zero at unmasked positions."""
    check_ndim("token_rewards", token_rewards, 2, "[B, A]")
    check_shape("mask", mask, "token_rewards", token_rewards)
    check_interval("gamma", gamma, 0.0, 1.0)
    m = bool_mask(mask)
    rew = torch.where(m, f32(token_rewards), 0.0)
    if gamma == 1.0:
        returns = rew.flip(1).cumsum(1).flip(1)
    else:
        returns = torch.zeros_like(rew)
        running = torch.zeros_like(rew[:, 0])
        for t in range(rew.shape[1] - 1, -1, -1):
            running = rew[:, t] + gamma * running
            returns[:, t] = running
    return torch.where(m, returns, 0.0)


def gae(token_rewards, values, mask, gamma, lam):
    """Generalized advantage estimation (V and R masked, V after the last position = 0):
    ``δ_t = R_t + γV_{t+1} - V_t``, ``Â_t = δ_t + γλÂ_{t+1}``; returns ``Â + V``.
    Both ``[B, A]``, zero at unmasked positions."""
    check_ndim("token_rewards", token_rewards, 2, "[B, A]")
    check_shape("values", values, "token_rewards", token_rewards)
    check_shape("mask", mask, "token_rewards", token_rewards)
    check_interval("gamma", gamma, 0.0, 1.0)
    check_interval("lam", lam, 0.0, 1.0)
    m = bool_mask(mask)
    rew = torch.where(m, f32(token_rewards), 0.0)
    val = torch.where(m, f32(values).detach(), 0.0)
    next_val = torch.cat([val[:, 1:], torch.zeros_like(val[:, :1])], dim=1)
    delta = rew + gamma * next_val - val
    adv = torch.zeros_like(delta)
    running = torch.zeros_like(delta[:, 0])
    for t in range(delta.shape[1] - 1, -1, -1):
        running = delta[:, t] + gamma * lam * running
        adv[:, t] = running
    return torch.where(m, adv, 0.0), torch.where(m, adv + val, 0.0)


def whiten(advantages, mask, use_std=True, eps=1e-8):
    """``(Â - μ) / sqrt(max(var, eps))`` over the masked positions (population variance);
    with ``use_std=False`` only ``Â - μ``. Zero at unmasked positions. Call it on the whole
    rollout batch (statistics are over everything passed in)."""
    check_shape("mask", mask, "advantages", advantages)
    m = bool_mask(mask)
    a = f32(advantages)
    mean = masked_mean(a, m)
    centered = a - mean
    if use_std:
        var = masked_mean(centered * centered, m)
        centered = centered * var.clamp(min=eps).rsqrt()
    return torch.where(m, centered, 0.0)


def whiten_sequences(advantages, mask, use_std=True, eps=1e-8):
    """Sequence-level whitening (TRL ``normalize_advantage``): each sequence with at least one
    masked position counts once, by its value ``a_i`` = the token mean of its advantages;
    ``μ``, ``σ`` = mean and **unbiased** std (``n - 1``) of those values, and every masked
    position becomes ``(Â - μ) / (σ + eps)`` (with ``use_std=False`` only ``Â - μ``). Under a
    sequence-level advantage (all of a row's tokens equal) this is TRL's per-sequence
    ``(a - mean) / (std + 1e-8)`` broadcast to the row's tokens; per-token advantages keep their
    spread within a row. With fewer than two sequences only the mean is removed. Zero at unmasked
    positions; call it on the whole rollout batch.
    (rows [1, 1], [2, -], [3, 3] → [-1, -1], [0, -], [1, 1]: sequence std 1, not the token one.)"""
    check_shape("mask", mask, "advantages", advantages)
    m = bool_mask(mask)
    a = f32(advantages)
    tokens = m.sum(-1)
    has = tokens > 0
    k = has.sum().to(a.dtype)
    seq = masked_sum(a, m, dim=-1) / tokens.clamp(min=1).to(a.dtype)
    mean = torch.where(has, seq, 0.0).sum() / k.clamp(min=1)
    centred = a - mean
    if use_std:
        var = torch.where(has, (seq - mean) ** 2, 0.0).sum() / (k - 1).clamp(min=1)
        centred = torch.where(k >= 2, centred / (var.sqrt() + eps), centred)
    return torch.where(m, centred, 0.0)


# --algo.advantage.whiten_level: which statistics whitening uses (same signature)
WHITEN_LEVELS = {"token": whiten, "sequence": whiten_sequences}


def compute_advantages_with_stats(
    estimator, rewards, mask, *, n, kl=None, kl_coef=0.0, values=None, gamma=1.0, lam=1.0,
    clip_range=(-10.0, 10.0), std_norm=True, sequence_kl=False, whiten=None, valid=None, whiten_level="token",
    std_eps=None, token_extra=None,
):
    """``compute_advantages`` plus a stats dict: ``reward_clip_count``, ``empty_rows``,
    ``gamma`` (the one actually used), ``whitened`` (bool)."""
    check_choice("estimator", estimator, ADVANTAGE_ESTIMATORS)
    spec = ADVANTAGE_ESTIMATORS[estimator]
    check_ndim("mask", mask, 2, "[B, A]")
    check_ndim("rewards", rewards, 1, "[B]")
    if rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} rows but mask has {mask.shape[0]}")
    check_interval("gamma", gamma, 0.0, 1.0)
    check_interval("lam", lam, 0.0, 1.0)
    if kl is not None:
        check_shape("kl", kl, "mask", mask)
    elif kl_coef != 0:
        raise ValueError(f"kl is None but kl_coef={kl_coef}; pass kl or set kl_coef=0")
    if spec.uses_values and values is None:
        raise ValueError(f"estimator={estimator!r} needs values (critic values [B, A])")
    if not spec.uses_values and values is not None:
        raise ValueError(f"values is only used by estimator 'gae', not {estimator!r}")
    if not (isinstance(kl_coef, (int, float)) and kl_coef >= 0):
        raise ValueError(f"kl_coef={kl_coef!r} must be a number >= 0")
    if whiten not in (None, True, False):
        raise ValueError(f"whiten={whiten!r} must be None (per-estimator default), True or False")
    check_choice("whiten_level", whiten_level, WHITEN_LEVELS)

    if spec.group and gamma != 1.0:
        if estimator not in _warned_gamma:
            _warned_gamma.add(estimator)
            warnings.warn(f"estimator={estimator!r} is a group estimator: gamma={gamma} is ignored, using "
                          f"1.0", stacklevel=2)
        gamma = 1.0

    r = f32(rewards)
    token_kl = kl
    if sequence_kl and kl is not None:
        r = r - kl_coef * masked_sum(kl, mask, dim=1)
        token_kl = None
    r = group_baseline(r, n, estimator, valid=valid, **({} if std_eps is None else {"eps": std_eps}))
    rew, stats = token_rewards_with_stats(r, token_kl, mask, kl_coef if token_kl is not None else 0.0,
                                          clip_range, token_extra)
    if spec.uses_values:
        adv, returns = gae(rew, values, mask, gamma, lam)
    else:
        returns = discounted_returns(rew, mask, gamma)
        adv = returns
    do_whiten = spec.whiten if whiten is None else whiten
    if do_whiten:
        adv = WHITEN_LEVELS[whiten_level](adv, mask, use_std=std_norm, **({} if std_eps is None else
                                                                            {"eps": std_eps}))
    stats.update(gamma=gamma, whitened=do_whiten)
    return adv, returns, stats


def compute_advantages(
    estimator, rewards, mask, *, n, kl=None, kl_coef=0.0, values=None, gamma=1.0, lam=1.0,
    clip_range=(-10.0, 10.0), std_norm=True, sequence_kl=False, whiten=None, valid=None, whiten_level="token",
    std_eps=None, token_extra=None,
):
    """Advantages and returns ``[B, A]`` (zero at unmasked positions) for a whole rollout batch.

    1. ``sequence_kl``: ``r ← r - kl_coef · Σ_t m_t kl_t`` (no per-token KL afterwards).
    2. ``group_baseline(r, n, estimator, valid=valid)`` (``valid``: samples that enter group statistics).
    3. ``token_rewards`` (clip after the baseline; per-token ``-kl_coef·kl`` unless sequence_kl; plus
       ``token_extra[B, A]`` on every masked position, e.g. the on-policy distillation term or a process
       reward model's step rewards: it is per token whatever ``sequence_kl``, unclipped, and no group
       baseline touches it; with gamma 1 each position's return sums the extra rewards at and after it).
    4. gae → GAE with ``values``; others → discounted returns (advantages = returns). Group
       estimators force ``gamma = 1`` (warning once per estimator).
    5. Whitening (``std_norm=False``: centring only): default for gae/reinforce/reinforce_baseline;
       ``whiten=True`` whitens any estimator, ``False`` none. ``whiten_level``: ``"token"``
       (``whiten``: every masked token counts, population variance) or ``"sequence"``
       (``whiten_sequences``: one value per sequence, unbiased std, ``/(σ + 1e-8)``; with
       ``whiten=True`` and sequence-level KL this is TRL ``normalize_advantage``).
       Returns are never whitened. ``std_eps`` (None: their defaults) is the ``eps`` of group_norm and
       of the whitening."""
    adv, returns, _ = compute_advantages_with_stats(
        estimator, rewards, mask, n=n, kl=kl, kl_coef=kl_coef, values=values, gamma=gamma, lam=lam,
        clip_range=clip_range, std_norm=std_norm, sequence_kl=sequence_kl, whiten=whiten, valid=valid,
        whiten_level=whiten_level, std_eps=std_eps, token_extra=token_extra)
    return adv, returns
