"""Small shared helpers: argument checks and masked reductions (float32)."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def f32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32 (a no-op when it already is)."""
    return x.float()


def check_choice(name: str, value, allowed: Iterable[str]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid; allowed values: {', '.join(map(repr, allowed))}")


def check_shape(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but must match {ref_name} {tuple(ref.shape)}"
        )


def check_ndim(name: str, x: torch.Tensor, ndim: int, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def check_interval(name: str, value: float, lo: float, hi: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name}={value!r} must be a number in [{lo}, {hi}]")


def check_pair(name: str, pair, *, min_low: float | None = None) -> tuple[float, float]:
    """A (low, high) pair with low < high (and low >= min_low when given)."""
    try:
        lo, hi = (float(v) for v in pair)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={pair!r} must be a pair (low, high) of numbers") from None
    if not lo < hi:
        raise ValueError(f"{name}={pair!r}: low must be < high")
    if min_low is not None and lo < min_low:
        raise ValueError(f"{name}={pair!r}: low must be >= {min_low}")
    return lo, hi


def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 (bool, int or float) mask as a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ x over positions where mask is set; masked positions contribute exactly 0 (even inf/NaN)."""
    m = bool_mask(mask)
    z = torch.where(m, f32(x), 0.0)
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ x·m / max(Σ m, 1): 0 where nothing is masked in."""
    m = bool_mask(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1).float()
