"""Learning-rate schedules: one multiplier function of the optimizer step drives every param group.

Each group keeps its own initial LR (AdamW, Muon and auxiliary AdamW groups differ); the schedule
multiplies all of them by the same factor ``f(s)``, where ``s`` counts optimizer steps taken (0 before
the first), ``T = total_steps`` and ``m = min_lr_ratio``. The names are transformers' ``SchedulerType``
names and, for every ``s`` in ``0..T``, the factors are those of transformers' ``get_scheduler`` with its
default extra parameters (``tests/engines/test_engines_schedulers.py`` compares them); the formulas here
are written for posttrain. After ``T`` the factor keeps its value at ``T``.

Warm-up: ``w = lr_warmup_steps`` when given, else ``ceil(T * lr_warmup_ratio)`` (OpenRLHF's count).
Unless a schedule says otherwise, ``f = s / w`` for ``s < w`` (it starts at 0, so with warm-up the
first update is a no-op) and, after it, ``p = (s - w) / max(1, T - w)`` runs from 0 to 1:

- ``linear``: ``(T - s) / max(1, T - w)``, down to 0.
- ``cosine``: ``0.5 * (1 + cos(pi * p))``, down to 0.
- ``cosine_with_restarts``: ``0.5 * (1 + cos(pi * frac(c * p)))`` for ``p < 1``, then 0; transformers'
  default ``c = 1`` cycle makes it ``cosine``.
- ``polynomial``: ``e + (1 - e) * (1 - p) ** power`` with transformers' defaults ``power = 1`` and an end
  LR of 1e-7, so ``e = 1e-7 / --adam.lr`` (which must then exceed 1e-7).
- ``constant``: 1 at every step; no warm-up.
- ``constant_with_warmup``: 1 after the warm-up.
- ``inverse_sqrt``: ``sqrt(tau / (s + tau - w))`` with ``tau = w`` (10000 when ``w = 0``).
- ``cosine_with_min_lr``: ``m + (1 - m) * 0.5 * (1 + cos(pi * p))``, down to ``m``. OpenRLHF 0.10.2
  passes ``min_lr_rate = --min_lr_ratio`` to transformers for it.
- ``cosine_warmup_with_min_lr``: the warm-up starts one step ahead, ``(s + 1) / max(1, w)``, and so does
  the decay, ``p' = (s - w + 1) / max(1, T - w)``: ``m + (1 - m) * 0.5 * (1 + cos(pi * p'))``.
- ``warmup_stable_decay``: warm-up from ``m``, ``m + (1 - m) * s / w``; then 1 until the last ``d`` steps,
  which decay as ``m + (1 - m) * 0.5 * (1 + cos(pi * q))`` with ``q = (s - (T - d)) / d``; ``m`` from ``T``.
  transformers has no default length for the decay (its ``num_decay_steps`` is required): here
  ``d = min(ceil(T / 10), T - w)``, the last 10% of the run.

``reduce_lr_on_plateau`` and ``greedy`` follow a metric, not the step: the names parse and are refused
with that reason (``METRIC_SCHEDULERS``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from posttrain.config.sections import LR_SCHEDULERS as SCHEDULERS  # --lr_scheduler's choices
from posttrain.config.sections import METRIC_LR_SCHEDULERS as METRIC_SCHEDULERS
from posttrain.config.sections import POLYNOMIAL_LR_END, OptimizerFields

POLYNOMIAL_POWER = 1.0  # transformers' default power
RESTART_CYCLES = 1  # transformers' default num_cycles of cosine_with_restarts
INVERSE_SQRT_TIMESCALE = 10_000  # transformers' timescale when there is no warm-up


def num_warmup_steps(total_steps: int, warmup_ratio: float, warmup_steps: int | None = None) -> int:
    """``warmup_steps`` when given, else ``ceil(total_steps * warmup_ratio)``."""
    if warmup_steps is not None:
        if warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps must be >= 0, got {warmup_steps}")
        return int(warmup_steps)
    if not 0.0 <= warmup_ratio <= 1.0:
        raise ValueError(f"lr_warmup_ratio must be in [0, 1], got {warmup_ratio}")
    return math.ceil(total_steps * warmup_ratio)


def wsd_decay_steps(total_steps: int, warmup: int) -> int:
    """warmup_stable_decay's decay length: ``min(ceil(T / 10), T - w)``, at least 0 (integer arithmetic)."""
    return max(0, min(-(-total_steps // 10), total_steps - warmup))


def lr_multiplier(name: str, *, total_steps: int, warmup_ratio: float = 0.03, warmup_steps: int | None = None,
                  min_lr_ratio: float = 0.1, peak_lr: float | None = None) -> Callable[[int], float]:
    """The factor ``f(step)`` applied to every group's initial LR (formulas in the module docstring).
    ``peak_lr`` (``--adam.lr``) is read by ``polynomial`` only, whose end LR is absolute."""
    if name in METRIC_SCHEDULERS:
        raise ValueError(f"lr_scheduler {name!r} is refused: {METRIC_SCHEDULERS[name]}")
    if name not in SCHEDULERS:
        raise ValueError(f"unknown lr_scheduler {name!r}; valid: {', '.join(SCHEDULERS)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    total, m = total_steps, min_lr_ratio
    w = num_warmup_steps(total, warmup_ratio, warmup_steps)
    end = 0.0
    if name == "polynomial":
        if peak_lr is None or not peak_lr > POLYNOMIAL_LR_END:
            raise ValueError(f"lr_scheduler 'polynomial' decays to lr {POLYNOMIAL_LR_END:g}: the peak "
                             f"learning rate must be above it, got {peak_lr}")
        end = POLYNOMIAL_LR_END / peak_lr
    decay = wsd_decay_steps(total, w)
    stable_end = total - decay  # warmup_stable_decay: the decay covers steps [T - d, T)

    def cos_down(p: float) -> float:  # 1 at p = 0 to 0 at p = 1
        return 0.5 * (1.0 + math.cos(math.pi * p))

    def factor(step: int) -> float:
        s = min(step, total)
        if name == "constant":
            return 1.0
        if name == "cosine_warmup_with_min_lr":
            if s < w:
                return (s + 1) / max(1, w)
            return max(0.0, m + (1.0 - m) * cos_down((s - w + 1) / max(1, total - w)))
        if name == "warmup_stable_decay":
            if s < w:
                return m + (1.0 - m) * s / max(1, w)
            if s < stable_end:
                return 1.0
            if s < total:
                return m + (1.0 - m) * cos_down((s - stable_end) / max(1, decay))
            return m
        if s < w:
            return s / w
        p = (s - w) / max(1, total - w)
        if name == "constant_with_warmup":
            return 1.0
        if name == "linear":
            return max(0.0, (total - s) / max(1, total - w))
        if name == "cosine":
            return max(0.0, cos_down(p))
        if name == "cosine_with_restarts":
            return 0.0 if p >= 1.0 else max(0.0, cos_down((RESTART_CYCLES * p) % 1.0))
        if name == "polynomial":
            return end + (1.0 - end) * (1.0 - p) ** POLYNOMIAL_POWER
        if name == "inverse_sqrt":
            tau = w or INVERSE_SQRT_TIMESCALE
            return math.sqrt(tau / (s + tau - w))
        return max(0.0, m + (1.0 - m) * cos_down(p))  # cosine_with_min_lr

    return factor


def schedule_of(opt: OptimizerFields, *, total_steps: int) -> Callable[[int], float]:
    """``lr_multiplier`` for an optimizer section (``--lr_scheduler``, ``--lr_warmup_steps`` or else
    ``--lr_warmup_ratio``, ``--min_lr_ratio``, ``--adam.lr``)."""
    return lr_multiplier(opt.lr_scheduler, total_steps=total_steps, warmup_ratio=opt.lr_warmup_ratio,
                         warmup_steps=opt.lr_warmup_steps, min_lr_ratio=opt.min_lr_ratio, peak_lr=opt.adam.lr)


def build_scheduler(optimizer: torch.optim.Optimizer, opt: OptimizerFields, *,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over all of ``optimizer``'s groups with ``schedule_of(opt, total_steps=...)``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_of(opt, total_steps=total_steps))
