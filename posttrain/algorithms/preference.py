"""Preference losses: DPO / cDPO / IPO on summed response log-probs, the reference-free ORPO / SimPO / CPO
terms, KTO on unpaired rows, and pairwise reward-model losses."""
from __future__ import annotations

import math

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
        losses = _sigmoid_pref(beta * h, label_smoothing)
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


def _check_pair(chosen, rejected):
    check_ndim("chosen_logps", chosen, 1, "[B]")
    check_shape("rejected_logps", rejected, "chosen_logps", chosen)
    return f32(chosen), f32(rejected)


def _sigmoid_pref(z, label_smoothing):
    """``-(1-ε) logσ(z) - ε logσ(-z)`` per pair: the (conservative) Bradley-Terry loss of a reward
    gap z."""
    check_interval("label_smoothing", label_smoothing, 0.0, 0.5)
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _log1mexp(x):
    """``log(1 - e^x)`` for x < 0, without cancellation on either side of x = -ln 2."""
    return torch.where(x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_logps, rejected_logps, lam=0.1):
    """ORPO's odds-ratio term on average (token-mean) response log-probs ``a_c, a_r`` [B] (each < 0),
    no reference: with ``log odds(y) = a - log(1 - e^a)`` and
    ``L = log odds(y_c) - log odds(y_r) = (a_c - a_r) - (log(1 - e^{a_c}) - log(1 - e^{a_r}))``,
    the term is ``mean(-λ logσ(L))``; ORPO's loss is this plus the chosen response's token-mean NLL
    ``mean(-a_c)`` (added by the caller, weight 1). Returns ``(term, chosen_rewards, rejected_rewards,
    log_odds)``: rewards ``λ·a`` and the log odds ratio ``L`` [B], detached."""
    ac, ar = _check_pair(chosen_logps, rejected_logps)
    if not (isinstance(lam, (int, float)) and lam >= 0):
        raise ValueError(f"lam={lam!r} must be a number >= 0")
    log_odds = (ac - ar) - (_log1mexp(ac) - _log1mexp(ar))
    term = -lam * F.logsigmoid(log_odds)
    return term.mean(), (lam * ac).detach(), (lam * ar).detach(), log_odds.detach()


def simpo_loss(chosen_logps, rejected_logps, beta=0.1, gamma=0.5, label_smoothing=0.0):
    """SimPO on average (token-mean) response log-probs ``a_c, a_r`` [B], no reference:
    ``mean(-(1-ε) logσ(β(a_c - a_r) - γ) - ε logσ(γ - β(a_c - a_r)))`` (γ: the target reward margin).
    Returns ``(loss, chosen_rewards, rejected_rewards)`` with rewards ``β·a`` detached."""
    ac, ar = _check_pair(chosen_logps, rejected_logps)
    if not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"beta={beta!r} must be a number > 0")
    losses = _sigmoid_pref(beta * (ac - ar) - gamma, label_smoothing)
    return losses.mean(), (beta * ac).detach(), (beta * ar).detach()


def cpo_loss(chosen_logps, rejected_logps, beta=0.1, label_smoothing=0.0):
    """CPO's preference term on summed response log-probs ``π_c, π_r`` [B], no reference:
    ``mean(-(1-ε) logσ(β(π_c - π_r)) - ε logσ(-β(π_c - π_r)))``; CPO's loss adds α times the chosen
    response's token-mean NLL (the caller's). Returns ``(term, chosen_rewards, rejected_rewards)`` with
    rewards ``β·π`` detached."""
    return simpo_loss(chosen_logps, rejected_logps, beta=beta, gamma=0.0, label_smoothing=label_smoothing)


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
