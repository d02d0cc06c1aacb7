"""How one optimizer step's samples are split over ranks and micro-batches.

A step takes `train.batch_size` sample indices (the global batch). Rank r gets the contiguous
slice r of `world_size` equal slices; its micro-batches hold `train.micro_batch_size` samples, or,
with `--train.dynamic_batch_enable`, as many samples as fit `--train.max_tokens_per_gpu` tokens x the GPUs of
a ring-attention / tensor-parallel group (`config.summary.micro_batch_tokens`).
"""
from __future__ import annotations

import numpy as np


def epoch_order(num_items: int, seed: int, epoch: int) -> np.ndarray:
    """Deterministic shuffle of the dataset for one epoch (so a resumed run sees the same order)."""
    return np.random.default_rng([seed, epoch]).permutation(num_items)


def steps_per_epoch(num_items: int, batch_size: int) -> int:
    """Full global batches per epoch; the incomplete tail batch is dropped (and reported)."""
    return num_items // batch_size


def rank_slice(step_indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    per_rank = len(step_indices) // world_size
    return step_indices[rank * per_rank:(rank + 1) * per_rank]


def micro_batches(indices, lengths, *, micro_batch_size: int,
                  max_tokens: int | None = None) -> list[list[int]]:
    """Split `indices` into micro-batches by count, or by token budget when `max_tokens` is set."""
    indices = [int(i) for i in indices]
    if max_tokens is None:
        return [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]
    from posttrain.data import token_budget_batches

    groups = token_budget_batches([lengths[i] for i in indices], max_tokens)
    return [[indices[j] for j in g] for g in groups]
