"""Preference losses: DPO / cDPO / IPO on summed response log-probs, and pairwise reward-model losses."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._util import check_choice, check_interval, check_ndim, check_shape, f32


def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
             beta=0.1, label_smoothing=0.0, ipo=False):
    """With ``h = (π_c - π_r) - (ref_c - ref_r)`` on summed log-probs ``[B]``:
    DPO/cDPO ``mean(-(1-ε) logσ(βh) - ε logσ(-βh))`` (ε = label_smoothing ∈ [0, 0.5]);
    IPO ``mean((h - 1/(2β))²)``. Returns ``(loss, chosen_rewards, rejected_rewards)`` with rewards
    ``β(π - ref)`` detached. At policy == reference the DPO loss is log 2."""
    check_ndim("policy_chosen_logps", policy_chosen_logps, 1, "[B]")
    for name, t in (("policy_rejected_logps", policy_rejected_logps), ("ref_chosen_logps", ref_chosen_logps),
                    ("ref_rejected_logps", ref_rejected_logps)):
        check_shape(name, t, "policy_chosen_logps", policy_chosen_logps)
    if not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"beta={beta!r} must be a number > 0")
    check_interval("label_smoothing", label_smoothing, 0.0, 0.5)
    if ipo and label_smoothing != 0:
        raise ValueError(f"label_smoothing={label_smoothing} is not used by IPO (ipo=True); set it to 0")
    pc, pr = f32(policy_chosen_logps), f32(policy_rejected_logps)
    rc, rr = f32(ref_chosen_logps).detach(), f32(ref_rejected_logps).detach()
    h = (pc - pr) - (rc - rr)
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses.mean(), (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


def _sigmoid_rm(chosen, rejected, margin):
    """mean(-logσ(r_c - r_r - margin))."""
    diff = chosen - rejected if margin is None else chosen - rejected - f32(margin)
    return -F.logsigmoid(diff).mean()


def _logexp_rm(chosen, rejected, margin):
    """mean(log(1 + exp(r_r - r_c)))."""
    if margin is not None:
        raise ValueError("margin is only supported by loss_type='sigmoid', not 'logexp'")
    return F.softplus(rejected - chosen).mean()


RM_LOSSES = {"sigmoid": _sigmoid_rm, "logexp": _logexp_rm}


def reward_model_loss(chosen, rejected, margin=None, loss_type="sigmoid"):
    """Pairwise reward-model loss on scalar rewards ``[B]`` (float32): ``sigmoid`` →
    ``mean(-logσ(r_c - r_r - margin))`` (margin optional, ``[B]`` or a number); ``logexp`` →
    ``mean(log(1 + exp(r_r - r_c)))``."""
    check_choice("loss_type", loss_type, RM_LOSSES)
    check_ndim("chosen", chosen, 1, "[B]")
    check_shape("rejected", rejected, "chosen", chosen)
    if isinstance(margin, torch.Tensor):
        check_shape("margin", margin, "chosen", chosen)
    elif margin is not None:
        margin = torch.tensor(float(margin), device=chosen.device)
    return RM_LOSSES[loss_type](f32(chosen), f32(rejected), margin)
