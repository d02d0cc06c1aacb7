"""Dynamic (token-budget) batching."""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)


def oversized_indices(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Indices of samples longer than the budget on their own."""
    return [i for i, n in enumerate(lengths) if n > max_tokens]


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Order-preserving greedy batching: walk the samples in order and close the current batch
    when adding the next one would make its token sum exceed ``max_tokens``.

    Every index appears once, in order; each batch has Σ lengths ≤ max_tokens except a sample
    longer than the budget, which gets a batch of its own and is logged as a warning (see
    ``oversized_indices``). Greedy in order keeps the data order (and so resumption by position)
    intact; it is not the minimum number of batches (first-fit-decreasing would be closer).
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(
            f"max_tokens (--train.max_tokens_per_gpu): must be a positive integer, got {max_tokens!r}"
        )
    batches: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"token_budget_batches: lengths[{i}] = {n} is negative")
        if current and total + n > max_tokens:
            batches.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        batches.append(current)
    big = oversized_indices(lengths, max_tokens)
    if big:
        logger.warning(
            "token_budget_batches: %d sample(s) exceed the budget of %d tokens and were put in batches of "
            "their own (indices %s, lengths %s); raise --train.max_tokens_per_gpu or lower --data.max_len.",
            len(big),
            max_tokens,
            big[:10],
            [lengths[i] for i in big[:10]],
        )
    return batches
