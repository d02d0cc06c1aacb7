"""Forward passes of the RL roles over an `Experience`, padded or packed, and how they are split
into micro-batches.

`Batching`: micro-batches of `micro_batch_size` samples, or with a token budget (`max_tokens`,
--train/--rollout.max_tokens_per_gpu with --train.dynamic_batch_enable); with `packed`
(--ds.packing_samples) each micro-batch is one row without padding (block-diagonal attention) and
the per-token outputs are scattered back to the padded `[b, T-1]` layout, equal to the padded
computation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.losses import entropy, token_logprobs
from posttrain.models import forward_logits, forward_values
from posttrain.trainers import batching
from posttrain.trainers.rl.experience import Experience


@dataclass(frozen=True)
class Batching:
    micro_batch_size: int
    max_tokens: int | None = None  # set => micro-batches by token budget
    packed: bool = False

    def micro_batches(self, exp: Experience) -> list[list[int]]:
        """Row groups of `exp`, in order: by count, or greedily by `max_tokens` real tokens."""
        lengths = exp.attention_mask.sum(1).tolist()
        return batching.micro_batches(range(len(exp)), lengths, micro_batch_size=self.micro_batch_size,
                                      max_tokens=self.max_tokens)


def _packed_batch(exp: Experience) -> tuple[dict, torch.Tensor]:
    """One packed row of `exp`'s real tokens (right padding: row-major order keeps each sample
    contiguous), and the boolean [b, T] map of where each packed token came from."""
    real = exp.attention_mask.bool()
    positions = exp.attention_mask.long().cumsum(1) - 1
    return {"input_ids": exp.sequences[real][None], "position_ids": positions[real][None]}, real


def _unpack(flat: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-token values of the packed row ([N]) back to the padded layout [b, T] (0 on padding)."""
    out = flat.new_zeros(real.shape)
    out[real] = flat
    return out


def policy_forward(model, exp: Experience, temperature: float, with_entropy: bool = False, packed: bool = False):
    """Log-probs `[b, T-1]` of the sampled tokens under `logits / temperature` (and the entropy of
    that distribution when asked) — the same computation as the rollout engine's. Column t scores
    token t+1; columns at padding (and, packed, at each sample's last token) are meaningless and
    must be masked by the caller's action mask."""
    if not packed:
        logits = forward_logits(model, exp.model_batch())[:, :-1]
        logp = token_logprobs(logits, exp.sequences[:, 1:], temperature)
        return logp, (entropy(logits, temperature) if with_entropy else None)
    inputs, real = _packed_batch(exp)
    logits = forward_logits(model, inputs)[0]  # [N, V]
    targets = torch.roll(inputs["input_ids"][0], -1)  # the next packed token (crosses samples at their ends)
    logp = _unpack(token_logprobs(logits, targets, temperature), real)[:, :-1]
    ent = _unpack(entropy(logits, temperature), real)[:, :-1] if with_entropy else None
    return logp, ent


def value_forward(model, exp: Experience, packed: bool = False) -> torch.Tensor:
    """Value of each state before an action: V(tokens ≤ t) in column t, `[b, T-1]`."""
    if not packed:
        return forward_values(model, exp.model_batch())[:, :-1]
    inputs, real = _packed_batch(exp)
    return _unpack(forward_values(model, inputs)[0], real)[:, :-1]



def to_device(exp: Experience, device) -> Experience:
    if device.type == "cpu":
        return exp
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in exp.__dict__.items()}
    return Experience(**fields)
