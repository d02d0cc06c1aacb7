"""Optimisers: AdamW with weight-decay exemptions, and Muon with an auxiliary AdamW.

Parameter roles (``param_roles``):
- ``decay``: AdamW parameters with weight decay — every trainable tensor with ``ndim >= 2``;
- ``no_decay``: biases and norm weights (``ndim < 2``) — never decayed;
- ``muon``: (optim="muon" only) 2-D *hidden* weight matrices — not the input embedding, the LM head,
  value/score heads (names containing embed / lm_head / score / value_head / v_head) or matrices
  with a dimension of 1. Everything else goes to the auxiliary AdamW groups.

``MuonAdamW`` is one ``torch.optim.Optimizer`` whose groups carry ``use_muon``; each group keeps its
own initial LR so one scheduler drives both halves. Muon update for a matrix ``W`` with gradient ``G``::

    B <- mu * B + (1 - mu) * G                       (momentum buffer)
    U <- (1 - mu) * G + mu * B  if nesterov else B
    O <- NewtonSchulz5(U) * sqrt(max(1, rows / cols)) (approximately U's orthogonal factor)
    W <- W * (1 - lr * wd) - lr * O

AdamW (aux groups): ``m, v`` bias-corrected, ``W <- W * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from posttrain.config.sections import OPTIMIZERS, OptimizerFields

_HEAD_NAMES = ("embed", "lm_head", "score", "value_head", "v_head", "wte", "wpe")
_NS_COEFFS = (3.4445, -4.7750, 2.0315)


def _head_param_ids(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        mod = fn() if callable(fn) else None
        if isinstance(mod, nn.Module):
            ids.update(id(p) for p in mod.parameters())
    return ids


def _layer_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape as a layer (ZeRO-3 partitioned params record it in ``ds_shape``)."""
    shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if shape is None else tuple(shape)


def param_roles(model: nn.Module, optim: str = "adam") -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Split trainable parameters into ``decay`` / ``no_decay`` / ``muon`` (rules in module docstring)."""
    if optim not in OPTIMIZERS:
        raise ValueError(f"unknown optim {optim!r}; valid: {', '.join(OPTIMIZERS)}")
    heads = _head_param_ids(model)
    roles: dict[str, list[tuple[str, nn.Parameter]]] = {"decay": [], "no_decay": [], "muon": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = _layer_shape(p)
        if len(shape) < 2:
            roles["no_decay"].append((name, p))
        elif (optim == "muon" and len(shape) == 2 and min(shape) > 1 and id(p) not in heads
              and not any(h in name.lower() for h in _HEAD_NAMES)):
            roles["muon"].append((name, p))
        else:
            roles["decay"].append((name, p))
    if not any(roles.values()):
        raise ValueError("the model has no trainable parameters (requires_grad=False everywhere)")
    return roles


def param_groups(model: nn.Module, opt: OptimizerFields) -> list[dict]:
    """Optimizer param groups (empty groups dropped) for the optimizer section `opt` (`--optim`, `--adam.*`,
    `--muon.*`); each dict carries ``use_muon`` and ``name``."""
    roles = param_roles(model, opt.optim)
    a, m = opt.adam, opt.muon
    adam = {"lr": a.lr, "betas": tuple(a.betas), "eps": a.eps, "use_muon": False}
    groups = [
        {"params": [p for _, p in roles["decay"]], "weight_decay": a.weight_decay, "name": "decay", **adam},
        {"params": [p for _, p in roles["no_decay"]], "weight_decay": 0.0, "name": "no_decay", **adam},
        {"params": [p for _, p in roles["muon"]], "lr": m.lr, "weight_decay": a.weight_decay,
         "momentum": m.momentum, "nesterov": m.nesterov, "ns_steps": m.ns_steps, "use_muon": True,
         "name": "muon"},
    ]
    return [g for g in groups if g["params"]]


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Quintic Newton–Schulz iteration (fp32): maps ``G = U S V^T`` to about ``U S' V^T``, ``S' ~ 1``."""
    a, b, c = _NS_COEFFS
    x = g.float()
    transposed = x.size(0) > x.size(1)
    if transposed:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if transposed else x).to(g.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for groups with ``use_muon=True``, AdamW for the others (formulas in the module docstring)."""

    def __init__(self, groups: Iterable[dict]):
        groups = list(groups)
        for g in groups:
            if "use_muon" not in g:
                raise ValueError("every MuonAdamW param group needs a use_muon flag")
            if g["use_muon"] and any(p.ndim != 2 for p in g["params"]):
                raise ValueError(f"Muon group {g.get('name')!r} holds a parameter that is not 2-D")
        super().__init__(groups, {"lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8,
                                  "momentum": 0.95, "nesterov": True, "ns_steps": 5})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf, mu = state["momentum_buffer"], group["momentum"]
                    buf.lerp_(p.grad, 1 - mu)
                    update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                    ortho = newton_schulz(update, group["ns_steps"])
                    p.mul_(1 - lr * wd).add_(ortho, alpha=-lr * math.sqrt(max(1.0, p.size(0) / p.size(1))))
                else:
                    if "step" not in state:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    beta1, beta2 = group["betas"]
                    state["step"] += 1
                    t = state["step"].item()
                    state["exp_avg"].lerp_(p.grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    denom = (state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
                    p.mul_(1 - lr * wd).addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** t))
        return loss


def build_optimizer(model: nn.Module, opt: OptimizerFields) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over decay/no_decay groups (--optim adam) or ``MuonAdamW`` (--optim muon)."""
    groups = param_groups(model, opt)
    if opt.optim == "muon":
        return MuonAdamW(groups)
    for g in groups:
        g.pop("use_muon")
    a = opt.adam
    return torch.optim.AdamW(groups, lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=a.weight_decay)
