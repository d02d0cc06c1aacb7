"""Loss aggregation, the clipped policy loss, the value loss, entropy and token log-probs.

Split invariance: every aggregation divides a sum over tokens or sequences by a denominator that
the caller can make global (``num_tokens``, ``num_seqs``, ``max_len`` of the whole optimizer step,
over all micro-batches and ranks). The step loss is then the *sum* of the micro-batch losses, and
the accumulated gradient is the same whatever the split.
"""
from __future__ import annotations

import torch

from ._util import (
    bool_mask,
    check_choice,
    check_ndim,
    check_pair,
    check_shape,
    f32,
    masked_mean,
    masked_sum,
)


def _denominator(name, given, local: torch.Tensor) -> torch.Tensor:
    """``given`` (global count) if not None, else the local count; never below 1."""
    if given is None:
        return local.float().clamp(min=1)
    if isinstance(given, torch.Tensor):
        return given.to(device=local.device, dtype=torch.float32).clamp(min=1)
    if not isinstance(given, (int, float)) or isinstance(given, bool) or given < 0:
        raise ValueError(f"{name}={given!r} must be None or a count >= 0")
    return torch.tensor(max(float(given), 1.0), device=local.device)


def _token_mean(loss, m, num_tokens, num_seqs, max_len):
    """Σ ℓm / N (N = num_tokens or local masked tokens)."""
    return masked_sum(loss, m) / _denominator("num_tokens", num_tokens, m.sum())


def _seq_mean_token_mean(loss, m, num_tokens, num_seqs, max_len):
    """mean over sequences with tokens of each sequence's token mean (S = num_seqs or local)."""
    tokens = m.sum(-1)
    per_seq = masked_sum(loss, m, dim=-1) / tokens.clamp(min=1).float()
    return per_seq.sum() / _denominator("num_seqs", num_seqs, (tokens > 0).sum())


def _seq_mean_token_sum(loss, m, num_tokens, num_seqs, max_len):
    """mean over sequences with tokens of each sequence's token sum."""
    return masked_sum(loss, m) / _denominator("num_seqs", num_seqs, (m.sum(-1) > 0).sum())


def _seq_sum_norm(loss, m, num_tokens, num_seqs, max_len):
    """Σ ℓm / (num_seqs · max_len) (Dr.GRPO); max_len defaults to the tensor's last dim."""
    if max_len is None:
        max_len = m.shape[-1]
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"max_len={max_len!r} must be an int >= 1")
    seqs = _denominator("num_seqs", num_seqs, (m.sum(-1) > 0).sum())
    return masked_sum(loss, m) / (seqs * max_len)


AGGREGATIONS = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_sum_norm": _seq_sum_norm,
}


def aggregate(loss, mask, mode="token_mean", num_tokens=None, num_seqs=None, max_len=None):
    """Reduce a per-token loss ``[B, A]`` to a scalar (float32); masked-out positions contribute
    exactly 0 (and get 0 gradient) even if they hold inf/NaN.

    - ``token_mean``: ``Σ ℓm / num_tokens``
    - ``seq_mean_token_mean``: ``Σ_seq (Σ_t ℓm / Σ_t m) / num_seqs``
    - ``seq_mean_token_sum``: ``Σ ℓm / num_seqs``
    - ``seq_sum_norm``: ``Σ ℓm / (num_seqs · max_len)``
    ``num_tokens`` / ``num_seqs`` default to the local counts (only sequences with at least one
    masked token count); pass the optimizer step's global counts, and for ``seq_sum_norm`` a fixed
    ``max_len`` (e.g. the generation max length), to make the summed loss split-invariant."""
    check_choice("mode", mode, AGGREGATIONS)
    check_shape("mask", mask, "loss", loss)
    check_ndim("loss", loss, 2, "[B, A]")
    m = bool_mask(mask)
    return AGGREGATIONS[mode](loss, m, num_tokens, num_seqs, max_len)


# ---------------------------------------------------------------- policy loss


def _ppo_log_ratio(logp, old_logp, rollout_logp, adv, m, is_on):
    """Token ratio log π/π_old; the IS weight multiplies the loss."""
    return logp - old_logp, adv, True


def _sequence_delta(logp, old_logp, rollout_logp, is_on):
    """``logp - base`` for the sequence ratios: base is rollout_logp when IS correction is on (the
    ratio then *is* the correction: no extra weight), else old_logp."""
    return logp - (rollout_logp if is_on else old_logp)


def _gspo_log_ratio(logp, old_logp, rollout_logp, adv, m, is_on):
    """GSPO sequence ratio: masked **mean** of ``logp - base`` per row, broadcast to its tokens."""
    seq = masked_mean(_sequence_delta(logp, old_logp, rollout_logp, is_on), m, dim=-1)
    return seq[:, None].expand_as(logp), adv, False


def _seq_sum_log_ratio(logp, old_logp, rollout_logp, adv, m, is_on):
    """TRL RLOO (v0.14-v0.21) sequence ratio: masked **sum** of ``logp - base`` per row (the log of
    π(y)/π_old(y) for the whole response), broadcast to its tokens, with the row's advantage taken as
    the token mean of its advantages (every token of a row then carries the same loss)."""
    seq = masked_sum(_sequence_delta(logp, old_logp, rollout_logp, is_on), m, dim=-1)
    seq_adv = masked_mean(adv, m, dim=-1)
    return seq[:, None].expand_as(logp), seq_adv[:, None].expand_as(adv), False


POLICY_LOSSES = {"ppo": _ppo_log_ratio, "gspo": _gspo_log_ratio, "seq_sum": _seq_sum_log_ratio}


def _tis(w, log_w, m, lo, hi):
    """Truncated IS: clamp(w, lo, hi)."""
    out = (w < lo) | (w > hi)
    return w.clamp(lo, hi), {"is_clamp_frac": masked_mean(out.float(), m)}


def _icepop(w, log_w, m, lo, hi):
    """Token mask: w · 1[lo ≤ w ≤ hi]."""
    keep = (w >= lo) & (w <= hi)
    return torch.where(keep, w, 0.0), {"is_filter_frac": masked_mean((~keep).float(), m)}


def _seq_mask_tis(w, log_w, m, lo, hi):
    """Sequence mask: 1[lo ≤ exp(masked_mean(old - rollout)) ≤ hi] · w."""
    seq_w = masked_mean(log_w, m, dim=-1).exp()
    keep = (seq_w >= lo) & (seq_w <= hi)
    has_tokens = m.any(-1)
    dropped = (~keep & has_tokens).sum().float() / has_tokens.sum().clamp(min=1).float()
    return torch.where(keep[:, None], w, 0.0), {
        "is_seq_filter_frac": dropped,
        "is_filter_frac": masked_mean((~keep[:, None]).expand_as(m).float(), m),
    }


IS_CORRECTIONS = {"tis": _tis, "icepop": _icepop, "seq-mask-tis": _seq_mask_tis}


def _check_policy_args(logp, old_logp, advantages, mask, rollout_logp, eps_low, eps_high, dual_clip,
                       loss_type, is_correction, is_threshold, agg) -> tuple[float, float]:
    """`policy_loss`'s argument checks (a ValueError naming the argument); returns `is_threshold`'s
    (lo, hi)."""
    check_choice("loss_type", loss_type, POLICY_LOSSES)
    check_choice("agg", agg, AGGREGATIONS)
    if is_correction is not None:
        check_choice("is_correction", is_correction, IS_CORRECTIONS)
        if rollout_logp is None:
            raise ValueError(f"is_correction={is_correction!r} needs rollout_logp (rollout engine log-probs)")
    check_ndim("logp", logp, 2, "[B, A]")
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        check_shape(name, t, "logp", logp)
    if rollout_logp is not None:
        check_shape("rollout_logp", rollout_logp, "logp", logp)
    for name, eps in (("eps_low", eps_low), ("eps_high", eps_high)):
        if not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"{name}={eps!r} must be a number >= 0")
    if dual_clip is not None and not (isinstance(dual_clip, (int, float)) and dual_clip > 1):
        raise ValueError(f"dual_clip={dual_clip!r} must be None or a number > 1")
    return check_pair("is_threshold", is_threshold, min_low=0.0)


def policy_loss(
    logp, old_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2, dual_clip=None, loss_type="ppo",
    rollout_logp=None, is_correction=None, is_threshold=(0.5, 5.0), agg="token_mean",
    num_tokens=None, num_seqs=None, max_len=None,
):
    """Clipped surrogate loss. ``ρ = exp(clamp(log_ratio, -20, 20))``,
    ``ℓ = -min(ρÂ, clamp(ρ, 1-eps_low, 1+eps_high)Â)``; with ``dual_clip = c > 1``, where ``Â < 0``:
    ``ℓ = -max(min(ρÂ, clip(ρ)Â), cÂ)``. ``loss_type``:

    - ``ppo``: token ratio ``log_ratio = logp - old_logp``.
    - ``gspo``: sequence ratio ``log_ratio = Σ_t m_t δ_t / max(Σ_t m_t, 1)`` broadcast to the row
      (``_gspo_log_ratio``; pick a sequence-level ``agg`` such as ``seq_mean_token_mean``).
    - ``seq_sum`` (TRL RLOO v0.14-v0.21): ``log_ratio = Σ_t m_t δ_t``, ``ρ = π(y)/π_old(y)`` of the
      whole response, and ``Â`` = the row's token-mean advantage, both broadcast to the row; with
      ``agg="seq_mean_token_mean"`` the loss is TRL's ``mean_seq max(-Âρ, -Â·clip(ρ, 1-eps_low,
      1+eps_high))`` and ``∂loss/∂logp_t = -Âρ / S`` on every token of a row whose unclipped term is
      taken (0 otherwise). Sequences without masked tokens are left out of the mean (TRL counts them).
    For both sequence ratios ``δ = logp - old_logp``, or ``logp - rollout_logp`` with IS correction on
    (the ratio is then the correction and the IS weight is not applied on top).

    IS correction (needs ``rollout_logp``): ``w = exp(old_logp - rollout_logp)`` (detached) multiplies
    ``ℓ`` as ``tis`` ``clamp(w, lo, hi)`` / ``icepop`` ``w·1[lo≤w≤hi]`` / ``seq-mask-tis``
    (per-sequence geometric-mean filter) with ``(lo, hi) = is_threshold``.
    ``old_logp``, ``advantages``, ``rollout_logp`` are treated as constants (detached).

    Returns ``(loss, metrics)``: ``aggregate(ℓ, mask, agg, ...)`` and detached 0-dim tensors
    (local masked means): ``clip_ratio``, ``ppo_kl`` (old - new), ``dual_clip_frac``, ``tokens``,
    and with rollout_logp ``rollout_kl`` (rollout - old), ``logprob_abs_gap`` (|old - rollout|),
    and the IS correction's ``is_clamp_frac`` / ``is_filter_frac`` / ``is_seq_filter_frac``."""
    lo, hi = _check_policy_args(logp, old_logp, advantages, mask, rollout_logp, eps_low, eps_high, dual_clip,
                                loss_type, is_correction, is_threshold, agg)

    m = bool_mask(mask)
    # Zero every input at masked-out positions first: padding garbage (even inf/NaN) can then
    # neither reach a metric nor give a masked position a non-zero gradient.
    logp = torch.where(m, f32(logp), 0.0)
    old = torch.where(m, f32(old_logp).detach(), 0.0)
    adv = torch.where(m, f32(advantages).detach(), 0.0)
    roll = None if rollout_logp is None else torch.where(m, f32(rollout_logp).detach(), 0.0)

    is_on = is_correction is not None
    log_ratio, adv, weight_applies = POLICY_LOSSES[loss_type](logp, old, roll, adv, m, is_on)
    ratio = log_ratio.clamp(-20.0, 20.0).exp()
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    objective = torch.minimum(surr, surr_clipped)
    metrics = {"clip_ratio": masked_mean((surr_clipped < surr).float(), m)}
    dual_taken = torch.zeros_like(m)
    if dual_clip is not None:
        floor = dual_clip * adv
        dual_taken = (adv < 0) & (floor > objective)
        objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)
    metrics["dual_clip_frac"] = masked_mean(dual_taken.float(), m)
    loss = -objective

    if roll is not None:
        metrics["rollout_kl"] = masked_mean(roll - old, m)
        metrics["logprob_abs_gap"] = masked_mean((old - roll).abs(), m)
    if is_correction is not None:
        log_w = old - roll
        w = log_w.clamp(-20.0, 20.0).exp()
        weight, is_stats = IS_CORRECTIONS[is_correction](w, log_w, m, lo, hi)
        metrics.update(is_stats)
        if weight_applies:
            loss = loss * weight

    metrics["ppo_kl"] = masked_mean(old - logp.detach(), m)
    metrics["tokens"] = m.sum().float()
    metrics = {k: v.detach() for k, v in metrics.items()}
    return aggregate(loss, m, agg, num_tokens, num_seqs, max_len), metrics


# ---------------------------------------------------------------- value loss


def value_loss_with_stats(values, old_values, returns, mask, clip=None, agg="token_mean",
                          num_tokens=None, num_seqs=None, max_len=None):
    """``value_loss`` plus ``{"value_clip_frac": masked fraction where the clipped term was larger}``."""
    check_shape("old_values", old_values, "values", values)
    check_shape("returns", returns, "values", values)
    check_shape("mask", mask, "values", values)
    m = bool_mask(mask)
    v = torch.where(m, f32(values), 0.0)
    g = torch.where(m, f32(returns).detach(), 0.0)
    err = (v - g) ** 2
    clip_frac = torch.zeros((), device=v.device)
    if clip is not None:
        if not (isinstance(clip, (int, float)) and clip > 0):
            raise ValueError(f"clip={clip!r} must be None or a number > 0")
        old = torch.where(m, f32(old_values).detach(), 0.0)
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - g) ** 2
        clip_frac = masked_mean((err_clip > err).float(), m)
        err = torch.maximum(err, err_clip)
    loss = 0.5 * aggregate(err, m, agg, num_tokens, num_seqs, max_len)
    return loss, {"value_clip_frac": clip_frac.detach()}


def value_loss(values, old_values, returns, mask, clip=None, agg="token_mean", num_tokens=None,
               num_seqs=None, max_len=None):
    """``0.5 · agg(max((V_clip - G)², (V - G)²))`` with ``V_clip = V_old + clamp(V - V_old, -clip, clip)``;
    without clip ``0.5 · agg((V - G)²)``."""
    return value_loss_with_stats(values, old_values, returns, mask, clip, agg, num_tokens, num_seqs,
                                 max_len)[0]


# ---------------------------------------------------------------- entropy / log-probs


def _check_temperature(temperature) -> float:
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a number > 0")
    return float(temperature)


def entropy(logits, temperature=1.0):
    """Entropy ``-Σ_v p_v log p_v`` of ``softmax(logits / temperature)`` over the last dim
    (float32, via log_softmax; ``-inf`` logits are fine). Shape ``logits.shape[:-1]``."""
    t = _check_temperature(temperature)
    z = f32(logits)
    if t != 1.0:
        z = z / t
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(-1)


def token_logprobs(logits, labels, temperature=1.0):
    """``log softmax(logits / temperature)[labels]`` as float32, shape ``labels.shape``.

    ``logits[..., V]`` is never modified in place; computed as ``z[label] - logsumexp(z)`` so no
    full ``[..., V]`` log-prob tensor is materialised beyond the scaled logits."""
    t = _check_temperature(temperature)
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"labels has shape {tuple(labels.shape)} but logits {tuple(logits.shape)} "
                         f"needs labels of shape {tuple(logits.shape[:-1])}")
    if labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"labels must be an integer tensor of token ids, got {labels.dtype}")
    vocab = logits.shape[-1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        raise ValueError(f"labels must be token ids in [0, {vocab}); got min {int(labels.min())}, "
                         f"max {int(labels.max())} (mask ignored positions instead of using -100)")
    z = f32(logits)
    if t != 1.0:
        z = z / t
    picked = z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(z, dim=-1)


def gathered_logprobs(logits, index, labels, temperature=1.0):
    """``log softmax(logits[index[m]] / temperature)[labels[m]]`` for flat ``logits [N, V]`` and
    ``index``, ``labels [M]``, as float32 ``[M]``. Several entries may read the same row (one position
    scoring the first token of several samples that share a prompt); computed as
    ``z[index, label] - logsumexp(z)[index]``, so no ``[M, V]`` copy is made."""
    t = _check_temperature(temperature)
    if logits.dim() != 2 or index.shape != labels.shape or index.dim() != 1:
        raise ValueError(f"logits must be [N, V] and index, labels [M]; got {tuple(logits.shape)}, "
                         f"{tuple(index.shape)}, {tuple(labels.shape)}")
    vocab = logits.shape[-1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        raise ValueError(f"labels must be token ids in [0, {vocab}); got min {int(labels.min())}, "
                         f"max {int(labels.max())}")
    z = f32(logits)
    if t != 1.0:
        z = z / t
    return z[index, labels] - torch.logsumexp(z, dim=-1)[index]
