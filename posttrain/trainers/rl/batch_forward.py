"""Forward passes of the RL roles over an `Experience`, and how they are split into micro-batches.

`Batching`: micro-batches of `micro_batch_size` samples, or with a token budget (`max_tokens`,
--train/--rollout.max_tokens_per_gpu with --train.dynamic_batch_enable). Each micro-batch runs in a
`batch_layout.Layout`: padded, packed (--ds.packing_samples) and/or with shared prefixes (a prompt computed
once for all its samples in the micro-batch; on by default, --ds.no_shared_prefix turns it off).
Only the columns a loss reads are computed (the LM head runs at those positions only), and the
per-token outputs come back in the padded `[b, T-1]` layout, equal to the padded computation.

With a `context` (`models.parallel_groups.ContextGroups`: context parallelism) the micro-batch is packed
into one row and every rank of the group computes its contiguous slice of it (`ContextGroups.split`, run by
`models.forward`); the per-token outputs of the slices are gathered over the group (`ContextGroups.gather`),
so every rank holds the whole micro-batch's outputs and computes the same loss from them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.losses import entropy, gathered_logprobs
from posttrain.config.summary import micro_batch_tokens
from posttrain.models import forward_logits, forward_logprobs, forward_values
from posttrain.models.context_parallel import next_tokens
from posttrain.trainers import batching
from posttrain.trainers.rl.batch_layout import build_layout
from posttrain.trainers.rl.experience import Experience


@dataclass(frozen=True)
class Batching:
    micro_batch_size: int
    max_tokens: int | None = None  # set => micro-batches by token budget
    packed: bool = False
    shared_prefix: bool = False

    @property
    def layout(self) -> dict:
        """The layout keywords of `policy_forward` / `value_forward`."""
        return {"packed": self.packed, "shared": self.shared_prefix}

    def micro_batches(self, exp: Experience) -> list[list[int]]:
        """Row groups of `exp`, in order: by count, or greedily by `max_tokens` real tokens."""
        lengths = exp.attention_mask.sum(1).tolist()
        return batching.micro_batches(range(len(exp)), lengths, micro_batch_size=self.micro_batch_size,
                                      max_tokens=self.max_tokens)


def ppo_batchings(cfg, shared: bool) -> tuple[Batching, Batching, Batching]:
    """The training, the experience-making and the reference's `Batching` of a `ppo` config: --train /
    --rollout.micro_batch_size samples, or with --train.dynamic_batch_enable the --train /
    --rollout.max_tokens_per_gpu budgets (rollout: default train's) per GPU, a micro-batch holding that x ring
    x the role's TP tokens (`config.summary.micro_batch_tokens`): the actor and critic are split by
    tensor parallelism, the reference is not (TP 1). `shared`: the shared-prefix layout."""
    dynamic = cfg.train.dynamic_batch_enable
    train = micro_batch_tokens(cfg, cfg.train.max_tokens_per_gpu) if dynamic else None
    rollout = cfg.rollout.max_tokens_per_gpu or cfg.train.max_tokens_per_gpu
    forward = micro_batch_tokens(cfg, rollout) if dynamic else None
    ref = micro_batch_tokens(cfg, rollout, tensor=1) if dynamic else None
    return (Batching(cfg.train.micro_batch_size, train, cfg.ds.packing_samples, shared),
            Batching(cfg.rollout.micro_batch_size, forward, cfg.ds.packing_samples, shared),
            Batching(cfg.rollout.micro_batch_size, ref, cfg.ds.packing_samples, shared))


def policy_forward(model, exp: Experience, temperature: float, with_entropy: bool = False,
                   packed: bool = False, shared: bool = False, context=None):
    """Log-probs `[b, T-1]` of the sampled tokens under `logits / temperature` (and the entropy of
    that distribution when asked) — the same computation as the rollout engine's. Column t scores
    token t+1; only the columns from each row's first action to its end are computed, the others
    are 0 and must be masked by the caller's action mask. `context`: split over a context-parallel group."""
    if context is not None:
        return _split_policy_forward(model, exp, temperature, with_entropy, context)
    lay = build_layout(exp, packed=packed, shared=shared)
    keep, at = lay.kept_columns()
    index = lay.src_row * len(keep) + at
    if not with_entropy:  # the logits in row chunks when they are large (models.forward_logprobs)
        return lay.scatter(forward_logprobs(model, lay.inputs, keep, index, lay.targets, temperature)), None
    logits = forward_logits(model, lay.inputs, keep=keep)  # [R, K, V]
    flat = logits.reshape(-1, logits.shape[-1])
    logp = lay.scatter(gathered_logprobs(flat, index, lay.targets, temperature))
    return logp, lay.scatter(entropy(flat, temperature)[index])


def value_forward(model, exp: Experience, packed: bool = False, shared: bool = False,
                  context=None) -> torch.Tensor:
    """Value of each state before an action: V(tokens ≤ t) in column t, `[b, T-1]` (0 outside the
    columns from each row's first action to its end). `context`: split over a context-parallel group."""
    # packed into one row, this rank's slice run; the whole row's values come back
    split = context is not None
    lay = build_layout(exp, packed=packed or split, shared=shared and not split)
    batch = context.split(lay.inputs["input_ids"], lay.inputs["position_ids"]) if split else lay.inputs
    values = forward_values(model, batch)
    return lay.scatter(values[lay.src_row, lay.src_col])


def _split_policy_forward(model, exp: Experience, temperature: float, with_entropy: bool, context):
    """`policy_forward` over a context-parallel group: this rank scores the read columns in its slice (their
    labels, the next tokens, taken from the whole row), zeros elsewhere; the slices gathered over the group.
    Every rank runs exactly one forward (the attention's collectives pair up across the group)."""
    lay = build_layout(exp, packed=True)
    local = context.split(lay.inputs["input_ids"], lay.inputs["position_ids"])
    width = local["input_ids"].shape[1]
    start = context.rank * width
    keep = torch.unique(lay.src_col)
    keep = keep[(keep >= start) & (keep < start + width)]
    labels = next_tokens(lay.inputs["input_ids"], 0)[0, keep]
    logits = forward_logits(model, local, keep=keep - start)
    flat = logits.reshape(-1, logits.shape[-1])
    index = torch.arange(len(keep), device=flat.device)

    def whole_row(values: torch.Tensor) -> torch.Tensor:
        row = values.new_zeros(width).index_put((keep - start,), values)
        return lay.scatter(context.gather(row)[lay.src_col])

    logp = whole_row(gathered_logprobs(flat, index, labels, temperature))
    return logp, whole_row(entropy(flat, temperature)) if with_entropy else None


def to_device(exp: Experience, device) -> Experience:
    if device.type == "cpu":
        return exp
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in exp.__dict__.items()}
    return Experience(**fields)
