"""One sampling step: next tokens and their log-probs from next-token logits [B, V]; per-prompt
seeds and per-sample generators (``check_seeds``, ``sample_generators``)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.algorithms.losses import token_logprobs
from posttrain.rollout.types import _is_int, rank_seed

Generators = torch.Generator | Sequence[torch.Generator] | None


def check_seeds(seeds, num_prompts: int) -> list[int] | None:
    """Per-prompt seeds as given to ``generate(..., seeds=...)``: None, or one int in [0, 2**63)
    per prompt (ValueError naming the problem otherwise)."""
    if seeds is None:
        return None
    if isinstance(seeds, torch.Tensor):
        seeds = seeds.tolist()
    if isinstance(seeds, (str, bytes)) or not hasattr(seeds, "__iter__"):
        raise ValueError(f"seeds must be None or a list of ints (one per prompt), not {type(seeds).__name__}")
    seeds = list(seeds)
    if len(seeds) != num_prompts:
        raise ValueError(f"seeds has {len(seeds)} entries for {num_prompts} prompts")
    bad = [s for s in seeds if not (_is_int(s) and 0 <= s < 2**63)]
    if bad:
        raise ValueError(f"seeds holds {bad[0]!r}; every seed must be an integer in [0, 2**63)")
    return [int(s) for s in seeds]


def sample_generators(prompt_seeds: Sequence[int], n: int) -> list[torch.Generator]:
    """One CPU ``torch.Generator`` per sample, group-contiguous: sample j of prompt i is seeded with
    ``rank_seed(prompt_seeds[i], 1, j)``, so its draws depend on nothing but its prompt's seed and j
    (not on the other prompts, the batch split or the device)."""
    return [torch.Generator().manual_seed(rank_seed(s, 1, j)) for s in prompt_seeds for j in range(n)]


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: Generators,
                uniforms: torch.Tensor | None = None,
                banned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; return (tokens [B] long, logprobs [B] float32).

    ``generator``: one ``torch.Generator`` (or None: the global RNG) for the whole batch, or a
    list of B generators, one per row (row b's draw then comes from ``generator[b]`` alone);
    ``uniforms`` [B] (float64 in [0, 1)), when given, are the rows' draws instead (the decode loop
    takes each sample's draws from its own generator in blocks, ``decode_batch.Sequence.uniform``).
    temperature > 0: draw (inverse CDF, ``_draw``, with ``generator``) from
    ``softmax(logits / temperature)`` restricted to the top-p nucleus (the most likely tokens, in
    decreasing order, up to and including the first one at which the cumulative mass reaches
    ``top_p``). temperature 0: argmax. The draw walks the vocabulary in token-id order (the
    nucleus is a mask over it): float noise that reorders near-equal probabilities (other padding,
    other batch) cannot change which token a uniform maps to.
    ``banned`` [B, V] bool (``min_tokens``: the stop ids of rows still below their minimum): those
    tokens are never drawn; the nucleus is taken over the remaining mass (vLLM applies ``min_tokens``
    before top-p too). A row whose every token is banned is sampled unbanned.
    The log-prob is always ``token_logprobs(logits, token, temperature)`` of the full
    distribution (temperature 1 when greedy), never renormalised over the nucleus or the ban: it is
    what the trainer recomputes from the same weights."""
    logits = logits.float()
    if banned is not None:
        banned = banned & ~banned.all(-1, keepdim=True)
    if temperature == 0:
        tokens = (logits if banned is None else logits.masked_fill(banned, float("-inf"))).argmax(-1)
        return tokens, token_logprobs(logits, tokens, 1.0)
    # token_logprobs' arithmetic (z = logits / t, z[token] - logsumexp(z)), its logsumexp reused for the
    # probabilities exp(z - lse)
    z = logits / temperature if temperature != 1.0 else logits
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    probs = (z - lse).exp_()
    mass = top_p
    if banned is not None:
        probs = probs.masked_fill_(banned, 0.0)
        mass = top_p * probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = (sorted_probs.cumsum(-1) - sorted_probs) >= mass  # the first token always stays
        probs = probs.masked_fill(torch.zeros_like(outside).scatter_(-1, order, outside), 0.0)
    tokens = _draw(probs, generator, uniforms)
    return tokens, (z.gather(-1, tokens[:, None]) - lse).squeeze(-1)


def _uniforms(rows: int, generator: Generators, device) -> torch.Tensor:
    """[rows, 1] float64 uniforms in [0, 1): from one generator, or one draw from each of ``rows``
    generators (each on its own device; the result is moved to ``device``)."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.rand(rows, 1, generator=generator, dtype=torch.float64, device=device)
    if len(generator) != rows:
        raise ValueError(f"{len(generator)} generators for {rows} rows; pass one generator per row of logits")
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device) for g in generator]
                     ).to(device)[:, None]


def _draw(weights: torch.Tensor, generator: Generators, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """One index per row with probability ∝ ``weights`` (>= 0) by inverse-CDF sampling: the first
    index whose float64 cumulative weight exceeds ``u · total``, ``u ~ U[0, 1)``. One random number
    per row, from ``generator`` or, given a list, from the row's own generator (``torch.multinomial``
    or an exponential race draw one per vocabulary entry, which dominates a tiny model's step on CPU).
    Zero-weight entries are never picked (up to a float64 rounding of probability ~2**-53). ``uniforms``
    [B], when given, are the draws (``generator`` unused)."""
    cdf = weights.cumsum(-1, dtype=torch.float64)
    u = _uniforms(weights.shape[0], generator, weights.device) if uniforms is None else uniforms[:, None]
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)
