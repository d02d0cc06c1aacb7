"""Knowledge-distillation losses: per-token divergences between a student's and a teacher's next-token
distributions, and their masked token mean.

With ``s = softmax(z_s / τ)`` and ``t = softmax(z_t / τ)`` over the vocabulary at one position (τ the
temperature, as TRL's GKD applies it to both; no τ² factor):

- ``forward``: ``KL(t ‖ s) = Σ_v t_v (log t_v − log s_v)`` (OpenRLHF 0.9's KD loss ``−Σ_v t_v log s_v`` minus
  the teacher's entropy, a constant of the student: same gradient);
- ``reverse``: ``KL(s ‖ t) = Σ_v s_v (log s_v − log t_v)``;
- ``jsd`` (generalized Jensen-Shannon, TRL's GKD ``beta``): with ``m = β t + (1 − β) s``,
  ``JSD_β = β KL(t ‖ m) + (1 − β) KL(s ‖ m)``; β = 0 is ``forward`` and β = 1 ``reverse`` (the mixture
  formula itself vanishes at both ends, so they are taken as the limits TRL takes).

`distillation_loss` reduces the per-token divergence as SFT's NLL: ``Σ_i m_i d_i / N`` with ``N`` the
target tokens of the whole optimizer step (``num_tokens``; default the local ``Σ m``), so how a step is split
into micro-batches and ranks does not change it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._util import check_choice, check_interval, check_shape, f32
from .losses import aggregate

KD_LOSSES = ("forward", "reverse", "jsd")


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)`` over the last dimension; a token p gives probability 0
    (a logit of -inf: a masked vocabulary row) adds 0."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-position ``JSD_β(t, s)`` (module doc) of logits ``[..., V]``, float32 ``[...]``: ``KL(t ‖ s)`` at
    β = 0, ``KL(s ‖ t)`` at β = 1. The teacher is detached (no gradient reaches it)."""
    check_shape("teacher_logits", teacher_logits, "student_logits", student_logits)
    check_interval("beta", beta, 0.0, 1.0)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a number > 0")
    log_s = F.log_softmax(f32(student_logits) / temperature, dim=-1)
    log_t = F.log_softmax(f32(teacher_logits).detach() / temperature, dim=-1)
    if beta == 0:
        return _kl(log_t, log_s)
    if beta == 1:
        return _kl(log_s, log_t)
    b = torch.tensor(float(beta), dtype=log_s.dtype, device=log_s.device)
    log_m = torch.logaddexp(log_t + torch.log(b), log_s + torch.log1p(-b))
    return beta * _kl(log_t, log_m) + (1 - beta) * _kl(log_s, log_m)


def kd_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "forward",
                  beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """The per-position divergence ``kind`` (one of KD_LOSSES): forward = JSD_0, reverse = JSD_1,
    jsd = JSD_beta (``beta`` is read only for jsd)."""
    check_choice("kind", kind, KD_LOSSES)
    b = {"forward": 0.0, "reverse": 1.0}.get(kind, beta)
    return generalized_jsd(student_logits, teacher_logits, b, temperature)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                      kind: str = "forward", beta: float = 0.5, temperature: float = 1.0,
                      num_tokens: float | None = None) -> torch.Tensor:
    """``Σ_i m_i d_i / num_tokens`` (float32 scalar) of the divergence ``d = kd_divergence(...)`` over logits
    ``[B, L, V]`` and a 0/1 mask ``[B, L]``; ``num_tokens`` defaults to ``Σ m`` (the local token mean); pass
    the optimizer step's target tokens for a split-invariant step loss."""
    d = kd_divergence(student_logits, teacher_logits, kind, beta, temperature)
    return aggregate(d, mask, "token_mean", num_tokens=num_tokens)
