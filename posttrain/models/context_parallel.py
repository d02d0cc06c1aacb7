"""Context parallelism (a ring of N ranks, `models.setup.ModelSetup.ring`): one packed row split over the N
ranks of a group, each rank computing its contiguous slice of the tokens, with attention exact over the
whole row.

Layout (OpenRLHF's): the row's real tokens, packed, are padded to a multiple of N and cut into N equal
contiguous slices; rank r holds slice r (`slice_row`). Every other per-token tensor is cut the same way, the
next-token labels before the cut (`next_tokens`), so a rank's last token still has its label. Position ids
stay each sample's own (0, 1, ... within its sample), so the rotary embedding is the unsplit row's.

Attention (`attention`, registered with transformers as "posttrain_context_parallel"): the keys and values
of the whole row are gathered from the group (`all_gather_rows`, differentiable: the backward sums every
rank's gradient of the gathered tensor and keeps this rank's slice), `head_stride` key/value heads at a
time (OpenRLHF's `--ds.ring_attn_head_stride`: fewer heads gathered at once, less memory, more calls); a
query attends a key of its own sample at or before its position in the row (block-diagonal causal over
the packed samples; padding attends nothing but itself). The result equals the unsplit row's attention to
float rounding; the all-gather form is what ring-flash-attn calls its llama3 variant (used by OpenRLHF).
On CUDA in bf16/fp16 the attention over the gathered keys runs in torch's varlen flash kernel
(`context_parallel_kernels`), elsewhere in sdpa with an additive mask (one per forward; on CPU with the
key/value heads grouped, `enable_gqa`).

Outputs read by a loss that every rank of the group computes alike (a sample's reward at its last token, the
RL losses over whole rows) are gathered with `gather_replicated`, whose backward keeps this rank's slice of
the (identical) gradient: summed over the group's ranks the gradients are the loss's, once.

Every collective here counts its bytes and seconds (`traffic()`), so a trainer reports what the flag costs.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.models.context_parallel_kernels import QueryRuns, fused_available, query_runs, varlen_attention

ATTENTION_NAME = "posttrain_context_parallel"
_state = threading.local()
_traffic = {"bytes": 0, "seconds": 0.0}


def traffic(reset: bool = True) -> dict[str, float]:
    """Bytes this rank sent into the group's collectives and the seconds they took since the last reset."""
    out = dict(_traffic)
    if reset:
        _traffic.update(bytes=0, seconds=0.0)
    return out


def _timed(collective, tensor: torch.Tensor, *args, **kwargs):
    start = time.perf_counter()
    collective(*args, **kwargs)
    _traffic["bytes"] += tensor.numel() * tensor.element_size()
    _traffic["seconds"] += time.perf_counter() - start


def padded_length(length: int, size: int) -> int:
    """`length` rounded up to a multiple of `size`."""
    return -(-length // size) * size


def slice_row(tensor: torch.Tensor, rank: int, size: int, pad_value) -> torch.Tensor:
    """Rank `rank`'s contiguous slice of a [1, T] (or [T, ...] along dim 0 after the batch dim) row, the row
    padded with `pad_value` to a multiple of `size` first."""
    length = tensor.shape[1]
    total = padded_length(length, size)
    if total > length:
        pad = torch.full((tensor.shape[0], total - length, *tensor.shape[2:]), pad_value, dtype=tensor.dtype,
                         device=tensor.device)
        tensor = torch.cat([tensor, pad], dim=1)
    part = total // size
    return tensor[:, rank * part:(rank + 1) * part]


def split_packed(input_ids: torch.Tensor, position_ids: torch.Tensor, rank: int,
                 size: int) -> tuple[dict, torch.Tensor]:
    """This rank's slice of a packed [1, T] row: model inputs `{"input_ids", "position_ids"}` and the bool
    [1, T/size] of its real tokens (False on the padding that made the row divisible)."""
    local = {"input_ids": slice_row(input_ids, rank, size, 0),
             "position_ids": slice_row(position_ids, rank, size, 0)}
    return local, slice_row(torch.ones_like(input_ids, dtype=torch.bool), rank, size, False)


def next_tokens(input_ids: torch.Tensor, pad_value: int) -> torch.Tensor:
    """[1, T] the token after each one in the row (`pad_value` after the last): the labels, made before the
    row is sliced so a slice's last token keeps its label."""
    return torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), pad_value)], dim=1)


class _AllGatherRows(torch.autograd.Function):
    """[B, ..., T_local, D] from every rank of `group` concatenated along dim -2 (the sequence); backward: the
    sum over ranks of the gathered tensor's gradient, this rank's slice (all-reduce: gloo
    has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _gather(tensor, group, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        _timed(dist.all_reduce, grad, grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        part = grad.shape[-2] // size
        return grad.narrow(-2, rank * part, part), None


def all_gather_rows(tensor: torch.Tensor, group) -> torch.Tensor:
    return _AllGatherRows.apply(tensor, group)


def _gather(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    tensor = tensor.contiguous()
    _timed(dist.all_gather, tensor, parts, tensor, group=group)
    return torch.cat(parts, dim=dim)


class _GatherReplicated(torch.autograd.Function):
    """[..., T_local] from every rank of `group` concatenated along the last dim; backward: this rank's slice
    of the gradient (every rank computes the same loss from the gathered tensor, module doc)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.rank, ctx.part = dist.get_rank(group), tensor.shape[-1]
        return _gather(tensor, group, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.part, ctx.part), None


def gather_replicated(tensor: torch.Tensor, group) -> torch.Tensor:
    """The whole row of a per-token output [..., T_local] (`_GatherReplicated`), for a loss every rank of
    the group computes alike."""
    return _GatherReplicated.apply(tensor, group)


class _GroupSum(torch.autograd.Function):
    """The sum over the ranks of `group` (every rank gets it). Backward: the gradient passes to each rank's
    own part unchanged: every rank computes the same loss from the sum and back-propagates it through its
    own part only, so the gradients summed over the ranks are the loss's gradient, once."""

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        _timed(dist.all_reduce, out, out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def group_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """`tensor` summed over the ranks of `group`, differentiable (`_GroupSum`): e.g. a packed sample's
    log-prob whose tokens lie on several ranks."""
    return _GroupSum.apply(tensor, group)


@dataclass
class _Context:
    group: object
    head_stride: int
    q_sample: torch.Tensor  # [B, T_local] each query's sample (-1: padding)
    q_index: torch.Tensor  # [B, T_local] its index in the row
    sample: torch.Tensor  # [B, T_total] every row token's sample
    index: torch.Tensor  # [B, T_total] every row token's index in the row
    keys_valid: torch.Tensor  # [B, T_total] the row's real tokens
    runs: QueryRuns | None = None  # the fused kernel's query runs, built at its first use
    bias: torch.Tensor | None = None  # the additive mask, built at the first masked call of the forward

    def allowed(self) -> torch.Tensor:
        """[B, 1, T_local, T_total] bool: query (local) may attend key (whole row): a key of its own sample at
        or before it, not padding; every query attends itself (no empty row)."""
        allowed = self.q_sample[:, :, None] == self.sample[:, None, :]
        allowed &= self.index[:, None, :] <= self.q_index[:, :, None]
        allowed &= self.keys_valid[:, None, :]
        allowed |= self.index[:, None, :] == self.q_index[:, :, None]
        return allowed[:, None]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """`allowed()` as 0 / -inf in `dtype`, made once per forward: sdpa turns a boolean mask into a float
        copy at every call and keeps it for the backward (one [T_local, T] copy per layer and head stride),
        while every call shares a float one. Built only where the masked path runs (the fused kernel
        needs no mask)."""
        if self.bias is None or self.bias.dtype != dtype:
            blocked = ~self.allowed()
            self.bias = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill_(
                blocked, float("-inf"))
        return self.bias

    def query_runs(self) -> QueryRuns:
        if self.runs is None:
            self.runs = query_runs(self.q_sample[0], self.q_index[0], self.sample[0])
        return self.runs


@contextlib.contextmanager
def context_parallel(group, position_ids: torch.Tensor, valid: torch.Tensor, head_stride: int = 1):
    """Forwards inside (and their recomputation under gradient checkpointing, until the next call) run with
    context-parallel attention over `group`: `position_ids` [B, T_local] are this rank's slice of the row's
    position ids (restarting at 0 for each packed sample), `valid` [B, T_local] its real tokens (False: the
    padding that made the row divisible)."""
    index = _gathered(torch.arange(position_ids.shape[1], device=position_ids.device).expand_as(position_ids)
                      + dist.get_rank(group) * position_ids.shape[1], group)
    sample = _gathered(_sample_ids(position_ids, valid, group), group)
    keys_valid = _gathered(valid.long(), group).bool()
    q_index = index.narrow(1, dist.get_rank(group) * position_ids.shape[1], position_ids.shape[1])
    q_sample = sample.narrow(1, dist.get_rank(group) * position_ids.shape[1], position_ids.shape[1])
    # stays set after the block, until the next forward sets its own: gradient checkpointing recomputes the
    # forward inside the backward, after the block has ended
    _state.context = _Context(group, head_stride, q_sample, q_index, sample, index, keys_valid)
    yield


@contextlib.contextmanager
def slice_context(batch: dict):
    """Forwards inside run over the group of `batch` when it is a context-parallel slice (its `cp`, made by
    `ContextGroups.shard` / `.split`: `context_parallel` of its `position_ids` and `cp_valid`); any other
    batch: no change. Re-entrant for one batch: a block inside another for the same batch sets nothing up
    again, so several forwards of one slice (e.g. DPO's reference and policy) share one set-up."""
    cp = batch.get("cp")
    if cp is None or getattr(_state, "batch", None) is batch:
        yield
        return
    _state.batch = batch
    try:
        with context_parallel(cp.group, batch["position_ids"], batch["cp_valid"], cp.head_stride):
            yield
    finally:
        _state.batch = None


def _gathered(tensor: torch.Tensor, group) -> torch.Tensor:
    return _gather(tensor, group, dim=1)


def _sample_ids(position_ids: torch.Tensor, valid: torch.Tensor, group) -> torch.Tensor:
    """The packed sample of each local token, numbered over the whole row: a sample starts where the position
    is 0. A slice starting inside a sample continues the previous rank's last sample."""
    starts = (position_ids == 0) & valid
    local = starts.long().cumsum(1)
    totals = _gathered(starts.long().sum(1, keepdim=True), group)  # [B, size]: sample starts per rank
    rank = dist.get_rank(group)
    before = totals[:, :rank].sum(1, keepdim=True)
    return torch.where(valid, local + before, torch.full_like(local, -1))


def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query [B, H, T_local, D], key / value [B, H_kv, T_local, D] →
    ([B, T_local, H, D], None); exact attention over the whole row (module doc)."""
    ctx = getattr(_state, "context", None)
    if ctx is None:
        raise RuntimeError("context-parallel attention ran before any `context_parallel(...)`")
    heads, kv_heads = query.shape[1], key.shape[1]
    per_kv = heads // kv_heads
    fused = fused_available(query)  # the varlen flash kernel (`context_parallel_kernels`), else masked sdpa
    outs = []
    for start in range(0, kv_heads, ctx.head_stride):
        stop = min(start + ctx.head_stride, kv_heads)
        k = all_gather_rows(key[:, start:stop], ctx.group)
        v = all_gather_rows(value[:, start:stop], ctx.group)
        q = query[:, start * per_kv:stop * per_kv]
        if fused:
            outs.append(varlen_attention(q, k, v, ctx.query_runs(), scaling))
        else:
            outs.append(_masked_attention(q, k, v, ctx.additive_mask(q.dtype), scaling, per_kv))
    return torch.cat(outs, dim=1).transpose(1, 2).contiguous(), None


def _masked_attention(q, k, v, mask, scaling, per_kv: int) -> torch.Tensor:
    """sdpa with the additive mask. On CPU the key/value heads go in grouped (`enable_gqa`): the CPU flash
    kernel takes them so and saves the gathered keys/values once, not once per query head. On CUDA they are
    repeated per query head first: with a mask and grouped heads torch falls back to its math kernel there,
    which keeps the whole [H, T_local, T] attention weights for the backward."""
    if per_kv > 1 and q.is_cuda:
        k, v = k.repeat_interleave(per_kv, dim=1), v.repeat_interleave(per_kv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                          enable_gqa=per_kv > 1 and not q.is_cuda)


def register() -> str:
    """Register the attention function (and no mask: it builds its own) with transformers;
    returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attention)
    try:
        from transformers import AttentionMaskInterface

        AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)
    except ImportError:  # older transformers: the attention function ignores the mask it gets
        pass
    return ATTENTION_NAME
