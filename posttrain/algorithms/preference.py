"""Preference losses: DPO / cDPO / IPO on summed response log-probs, KTO on unpaired rows, and pairwise
reward-model losses."""
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


KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_loss(policy_logps, ref_logps, desirable, kl, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0,
             loss_type="kto"):
    """KTO on unpaired rows: summed response log-probs ``[B]`` of the policy and the reference, ``desirable``
    the rows' labels ``[B]`` (bool), ``kl`` the KL estimate (a number or 0-d tensor: the mean of
    ``π(y'|x) - ref(y'|x)`` over mismatched pairs, see the trainer). With ``r = π - ref`` and
    ``z0 = max(kl, 0)`` (detached):

        kto:               desirable  w_d (1 - σ(β(r - z0)))     undesirable  w_u (1 - σ(β(z0 - r)))
        apo_zero_unpaired: desirable  w_d (1 - σ(βr))            undesirable  w_u σ(βr)   (no KL term)

    Returns ``(losses [B], rewards [B])``, per row in the input order (the caller averages: a step's loss is
    ``Σ losses / rows``), rewards ``βr`` detached. At policy == reference each loss is ``w/2``."""
    check_ndim("policy_logps", policy_logps, 1, "[B]")
    check_shape("ref_logps", ref_logps, "policy_logps", policy_logps)
    check_shape("desirable", desirable, "policy_logps", policy_logps)
    check_choice("loss_type", loss_type, KTO_LOSS_TYPES)
    if not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"beta={beta!r} must be a number > 0")
    for name, w in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not (isinstance(w, (int, float)) and w >= 0):
            raise ValueError(f"{name}={w!r} must be a number >= 0")
    r = f32(policy_logps) - f32(ref_logps).detach()
    good = desirable.to(device=r.device, dtype=torch.bool)
    if loss_type == "kto":
        z0 = torch.as_tensor(kl, dtype=torch.float32, device=r.device).detach().clamp(min=0)
        desired, undesired = 1 - torch.sigmoid(beta * (r - z0)), 1 - torch.sigmoid(beta * (z0 - r))
    else:
        desired, undesired = 1 - torch.sigmoid(beta * r), torch.sigmoid(beta * r)
    losses = torch.where(good, desirable_weight * desired, undesirable_weight * undesired)
    return losses, (beta * r).detach()


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
