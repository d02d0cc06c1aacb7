"""One sampling step: next tokens and their log-probs from next-token logits [B, V]."""
from __future__ import annotations

import torch

from posttrain.algorithms.losses import token_logprobs


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return (tokens [B] long, logprobs [B] float32).

    temperature > 0: draw (inverse CDF, ``_draw``, with ``generator``) from
    ``softmax(logits / temperature)`` restricted to the top-p nucleus (the most likely tokens, in
    decreasing order, up to and including the first one at which the cumulative mass reaches
    ``top_p``). temperature 0: argmax.
    The log-prob is always ``token_logprobs(logits, token, temperature)`` of the full
    distribution (temperature 1 when greedy), never renormalised over the nucleus."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, token_logprobs(logits, tokens, 1.0)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the first token always stays
        tokens = order.gather(-1, _draw(sorted_probs, generator)[:, None]).squeeze(-1)
    else:
        tokens = _draw(probs, generator)
    return tokens, token_logprobs(logits, tokens, temperature)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row with probability ∝ ``weights`` (>= 0) by inverse-CDF sampling: the first
    index whose float64 cumulative weight exceeds ``u · total``, ``u ~ U[0, 1)``. One random number
    per row (``torch.multinomial`` or an exponential race draw one per vocabulary entry, which
    dominates a tiny model's step on CPU). Zero-weight entries are never picked (up to a
    float64 rounding of probability ~2**-53)."""
    cdf = weights.double().cumsum(-1)
    u = torch.rand(weights.shape[0], 1, generator=generator, dtype=torch.float64, device=weights.device)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)
