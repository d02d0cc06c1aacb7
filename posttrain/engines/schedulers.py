"""Learning-rate schedules: one multiplier function of the optimizer step drives every param group.

Each group keeps its own initial LR (AdamW, Muon and auxiliary AdamW groups differ); the schedule
multiplies all of them by the same factor ``f(step)``, where ``step`` counts optimizer steps taken
(0 before the first). With ``w = ceil(total_steps * warmup_ratio)`` warm-up steps:

- ``cosine_with_min_lr``: ``f = s / w`` for ``s < w``; then with ``p = (s - w) / (total_steps - w)``
  ``f = m + (1 - m) * 0.5 * (1 + cos(pi * p))``, reaching ``m = min_lr_ratio`` at ``s = total_steps``.
- ``constant_with_warmup``: ``f = s / w`` for ``s < w``, then 1.
- ``linear``: ``f = s / w`` for ``s < w``, then ``(total_steps - s) / (total_steps - w)`` down to 0.

The warm-up starts at 0 (the HF / OpenRLHF convention), so with warm-up the first update is a no-op.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from posttrain.config.sections import LR_SCHEDULERS as SCHEDULERS  # --lr_scheduler's choices


def num_warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    """``ceil(total_steps * warmup_ratio)``."""
    if not 0.0 <= warmup_ratio <= 1.0:
        raise ValueError(f"lr_warmup_ratio must be in [0, 1], got {warmup_ratio}")
    return math.ceil(total_steps * warmup_ratio)


def lr_multiplier(name: str, *, total_steps: int, warmup_ratio: float = 0.03,
                  min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """The factor ``f(step)`` applied to every group's initial LR (formulas in the module docstring)."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown lr_scheduler {name!r}; valid: {', '.join(SCHEDULERS)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    warmup = num_warmup_steps(total_steps, warmup_ratio)
    decay = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = min(1.0, (step - warmup) / decay)
        if name == "constant_with_warmup":
            return 1.0
        if name == "linear":
            return max(0.0, 1.0 - progress)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, name: str, *, total_steps: int,
                    warmup_ratio: float = 0.03, min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over all of ``optimizer``'s groups with ``lr_multiplier(name, ...)``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(name, total_steps=total_steps, warmup_ratio=warmup_ratio,
                                 min_lr_ratio=min_lr_ratio))
