"""Mixing several row lists by sampling probabilities."""

from __future__ import annotations

import random
from collections.abc import Sequence

from posttrain.config.flag_values import parse_probs

from .errors import DataError
from .readers import Row


def mixing_weights(probs: str | Sequence[float] | None, n_sources: int) -> list[float] | None:
    """``"0.3,0.7"`` (parsed by `posttrain.config.parse_probs`) or a sequence → ``[0.3, 0.7]``; None/"" →
    None. Values must be ≥ 0, one per source, sum to 1."""
    if probs is None or (isinstance(probs, str) and not probs.strip()):
        return None
    flag = "--data.dataset_probs / --data.prompt_probs"
    try:
        values = parse_probs(probs) if isinstance(probs, str) else [float(p) for p in probs]
    except ValueError as e:
        raise DataError(f"{flag}: '{probs}' is not a comma-separated list of numbers ({e}).") from e
    if len(values) != n_sources:
        raise DataError(
            f"{flag}: got {len(values)} probabilities for {n_sources} dataset(s); give one per dataset."
        )
    if any(not v >= 0 for v in values) or abs(sum(values) - 1.0) > 1e-4:
        raise DataError(f"{flag}: probabilities {values} must be ≥ 0 and sum to 1 (sum is {sum(values):g}).")
    return values


def mix_rows(
    sources: list[list[Row]], probs: list[float], seed: int, max_samples: int | None = None
) -> list[Row]:
    """Interleave ``sources`` so that the mix follows ``probs`` (the "first exhausted" strategy).

    At each step a source ``k`` is drawn with probability ``probs[k]`` from ``random.Random(seed)``
    and its next row (in file order) is emitted. Mixing stops as soon as a drawn source has no
    rows left, or after ``max_samples`` rows. Hence the expected share of source k is probs[k],
    no row is repeated, and the result is a pure function of (sources, probs, seed).
    """
    rng = random.Random(seed)
    positions = [0] * len(sources)
    out: list[Row] = []
    indices = list(range(len(sources)))
    while max_samples is None or len(out) < max_samples:
        k = rng.choices(indices, weights=probs)[0]
        if positions[k] >= len(sources[k]):
            break
        out.append(sources[k][positions[k]])
        positions[k] += 1
    return out
