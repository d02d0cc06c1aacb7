"""The one forward pass every trainer and role runs: padded or packed batches, with log-probs identical
to running each sample alone, and context-parallel slices of a packed row.

* padded: `input_ids`, `attention_mask` [B, T] (left or right padding); position ids are
  `cumsum(attention_mask) - 1`, so every sample's real tokens sit at positions 0..L-1.
* packed: `input_ids`, `position_ids` [B, ΣT] (usually B = 1), position ids restarting at 0
  for each sample; an optional `attention_mask` marks tail padding. Token q attends to key k
  iff both are in the same sample and k <= q (block-diagonal causal). With sdpa / eager the
  mask is built here explicitly ([B, 1, ΣT, ΣT]); flash-attention backends get the position
  ids and derive the sample boundaries themselves.
* explicit mask: `input_ids`, `position_ids` [B, T] and a boolean `attention_mask` [B, 1, T, T]
  (True: query q may attend key k), e.g. a shared-prefix layout where several continuations attend
  one copy of their prompt. sdpa / eager only.

Every forward here also takes the rest of what a trainer or role hands over, so they compute only their loss:
* a context-parallel slice (`cp` in the batch: `ContextGroups.shard` / `.split`): this
  rank's contiguous part of one packed row, run with attention over the whole row (`slice_context`);
  `forward_values` returns the whole row's values (gathered over the group), the logits stay this rank's;
* `token_weights` in the batch (RL's shared-prefix layout): the MoE router loss weighs each token so
  (`moe.router_token_weights`).
`next_token_logits` aligns logits, labels and loss mask for each layout, `sequence_logprobs` sums them per
sample (over the group for a slice) and `last_token_values` reads each sequence's value at its last token.

`forward_logits(..., keep=cols)` computes the LM head only at the columns `cols` (a 1D index
tensor, transformers' `logits_to_keep`), so no [B, T, V] tensor exists beyond the positions a loss
reads; a model without `logits_to_keep` computes all columns and is indexed afterwards.

`forward_logprobs(..., keep, index, labels, temperature)` = `gathered_logprobs` of those logits, computed
without holding them whole when they are large (more than `LOGITS_CHUNK_BYTES`): for that one forward the
LM head's `forward` is replaced by one that returns the log-probs instead of the logits, computing the
head and the log-prob on row chunks inside activation checkpoints, so forward keeps no logits and backward
recomputes one chunk at a time (peak: about 4 chunks of logits instead of 4 whole [R, K, V] tensors; cost:
the head's forward once more). The head is still called once per forward, as a module, so ZeRO-3 gathers
its weight once for the forward and once for the backward, as on the whole-logits path: ranks whose
micro-batches take different paths make the same collective calls. The first call on a model checks the
chunked result against the whole-logits one on a few rows and keeps the whole-logits path when they differ
(a model that transforms its logits after the head, e.g. soft-capping); under ZeRO-3 every rank runs that
check on its first call, whatever its micro-batch's size (the check's forwards are collective too).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from posttrain.algorithms.losses import gathered_logprobs, token_logprobs
from posttrain.models.context_parallel import gather_replicated, group_sum, slice_context
from posttrain.models.moe import router_token_weights
from posttrain.models.saving import unwrap_model
from posttrain.models.vision import is_vision_model, vision_forward_inputs

_MASKED_BACKENDS = ("sdpa", "eager")


def sample_index(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] → [B, T] index of the packed sample each token belongs to: a new sample starts
    wherever the position does not continue the previous one (p[t] != p[t-1] + 1)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, 1, T, T], True where query q may attend key k: same sample, k <= q, and key
    k not padding. The diagonal is always True so no row is empty (padding rows stay finite)."""
    seg = sample_index(position_ids)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    if attention_mask is not None:
        mask &= attention_mask.bool()[:, None, :]
    mask |= torch.eye(t, dtype=torch.bool, device=position_ids.device)
    return mask[:, None]


def _attn_backend(model) -> str:
    config = getattr(unwrap_model(model), "config", None)
    return getattr(config, "_attn_implementation", None) or "eager"


def _param_dtype(model) -> torch.dtype:
    return next(unwrap_model(model).parameters()).dtype


def model_inputs(model, batch: dict) -> dict:
    """Keyword arguments for `model(**kwargs)` implementing the padded / packed contract above."""
    input_ids = batch["input_ids"]
    attention_mask = batch.get("attention_mask")
    position_ids = batch.get("position_ids")
    if attention_mask is not None and attention_mask.dim() != 4 and attention_mask.shape != input_ids.shape:
        raise ValueError(f"batch['attention_mask'] shape {tuple(attention_mask.shape)} != input_ids "
                         f"shape {tuple(input_ids.shape)}")
    kwargs = {"input_ids": input_ids, "use_cache": False}
    if is_vision_model(model):
        return _vision_inputs(model, kwargs, batch)
    if attention_mask is not None and attention_mask.dim() == 4:
        return _explicit_mask_inputs(model, kwargs, attention_mask, position_ids)
    if position_ids is None:
        if attention_mask is None:
            return kwargs
        kwargs["attention_mask"] = attention_mask
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return kwargs
    if position_ids.shape != input_ids.shape:
        raise ValueError(f"batch['position_ids'] shape {tuple(position_ids.shape)} != input_ids "
                         f"shape {tuple(input_ids.shape)}")
    kwargs["position_ids"] = position_ids
    backend = _attn_backend(model)
    if backend in _MASKED_BACKENDS:
        kwargs["attention_mask"] = _backend_mask(model, backend,
                                                 block_causal_mask(position_ids, attention_mask))
    elif attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"packed batch with padding needs the sdpa or eager backend, not {backend!r}; "
                         "drop the padding (flash attention takes sample boundaries from position_ids)")
    return kwargs


def _vision_inputs(model, kwargs: dict, batch: dict) -> dict:
    """A vision-language model's inputs for a padded batch: the ids, the 2D mask and the batch's image tensors
    (`batch["image_inputs"]`, `vision.merge_image_inputs` of its rows); no position ids, as the model derives
    its (multi-axis) rotary positions from the mask and the image grid itself. Packed and explicitly masked
    layouts are refused: their position ids would be text positions."""
    mask = batch.get("attention_mask")
    if batch.get("position_ids") is not None or (mask is not None and mask.dim() == 4):
        raise ValueError("a vision-language model takes padded batches only (no packing, no shared-prefix "
                         "layout): it computes its rotary positions per row from the image grid")
    if mask is not None:
        kwargs["attention_mask"] = mask
    return {**kwargs, **vision_forward_inputs(model, kwargs["input_ids"], batch.get("image_inputs") or {})}


def _backend_mask(model, backend: str, mask: torch.Tensor) -> torch.Tensor:
    """A boolean [B, 1, T, T] mask as an additive float one, made once per forward: eager adds it to the
    attention scores (its dtype's minimum where masked); sdpa gets 0 / -inf, what it would make of the boolean
    mask itself, but at every layer, keeping each [T, T] copy for the backward."""
    dtype = _param_dtype(model)
    masked = torch.finfo(dtype).min if backend == "eager" else float("-inf")
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, masked)


def _explicit_mask_inputs(model, kwargs: dict, mask: torch.Tensor, position_ids) -> dict:
    b, t = kwargs["input_ids"].shape
    if mask.dtype != torch.bool or tuple(mask.shape) != (b, 1, t, t):
        raise ValueError(f"a 4D batch['attention_mask'] must be boolean [B, 1, T, T] = {(b, 1, t, t)}, "
                         f"not {mask.dtype} {tuple(mask.shape)}")
    if position_ids is None or tuple(position_ids.shape) != (b, t):
        raise ValueError("a 4D batch['attention_mask'] needs batch['position_ids'] of shape [B, T]")
    backend = _attn_backend(model)
    if backend not in _MASKED_BACKENDS:
        raise ValueError(f"an explicit attention mask needs the sdpa or eager backend, not {backend!r}")
    kwargs["position_ids"] = position_ids
    kwargs["attention_mask"] = _backend_mask(model, backend, mask)
    return kwargs


def accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (transformers >= 4.45 models)."""
    base = unwrap_model(model)
    if hasattr(base, "peft_config"):
        base = base.get_base_model()
    return _takes_logits_to_keep(type(base))


@functools.cache
def _takes_logits_to_keep(cls) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def _running(model, batch: dict) -> contextlib.ExitStack:
    """What a forward of `batch` runs inside (module doc): its context-parallel group, its router token
    weights."""
    stack = contextlib.ExitStack()
    stack.enter_context(slice_context(batch))
    stack.enter_context(router_token_weights(model, batch.get("token_weights")))
    return stack


def forward_logits(model, batch: dict, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 logits [B, T, V] of a causal LM for a padded, packed, explicitly masked batch or a
    context-parallel slice (module doc); with `keep` (1D column indices) only those columns:
    [B, len(keep), V]. Call through the wrapper (DDP / DeepSpeed / peft) so its hooks run."""
    with _running(model, batch):
        return _logits(model, batch, keep)


def _logits(model, batch: dict, keep: torch.Tensor | None) -> torch.Tensor:
    kwargs = model_inputs(model, batch)
    if keep is None:
        return model(**kwargs).logits.float()
    if accepts_logits_to_keep(model):
        return model(**kwargs, logits_to_keep=keep).logits.float()
    return model(**kwargs).logits[:, keep].float()


LOGITS_CHUNK_BYTES = 128 * 2**20  # float32 logits above this are computed in row chunks of about this size
_CHECK_ROWS = 4  # rows of the first call compared between the chunked and the whole-logits computation
_chunking_ok: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the check's outcome


def forward_logprobs(model, batch: dict, keep: torch.Tensor, index: torch.Tensor, labels: torch.Tensor,
                     temperature: float = 1.0, chunk_bytes: int | None = None) -> torch.Tensor:
    """`gathered_logprobs(forward_logits(model, batch, keep).reshape(-1, V), index, labels, temperature)`,
    float32 [M], with the logits in row chunks when they exceed `chunk_bytes` (module doc)."""
    with _running(model, batch):
        return _logprobs(model, batch, keep, index, labels, temperature, chunk_bytes)


def _logprobs(model, batch: dict, keep: torch.Tensor, index: torch.Tensor, labels: torch.Tensor,
              temperature: float, chunk_bytes: int | None) -> torch.Tensor:
    budget = LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    head = _plain_head(model)
    vocab = head.out_features if head is not None else 0
    large = batch["input_ids"].shape[0] * len(keep) * vocab * 4 > budget
    checked = head is not None and (large or hasattr(head.weight, "ds_id")) and _chunks_match(
        model, head, batch, keep, temperature)
    if not (checked and large):
        logits = _logits(model, batch, keep)
        return gathered_logprobs(logits.reshape(-1, logits.shape[-1]), index, labels, temperature)
    with _head_returns_logprobs(head, index, labels, temperature, max(1, budget // (vocab * 4))) as calls:
        out = model(**model_inputs(model, batch), logits_to_keep=keep).logits
    if calls[0] != 1:
        raise RuntimeError(f"the LM head ran {calls[0]} times in one forward (expected once)")
    return out


def _plain_head(model) -> torch.nn.Linear | None:
    """The LM head when the chunked path may apply: a Linear output layer of a model that takes
    `logits_to_keep`."""
    base = unwrap_model(model)
    if hasattr(base, "peft_config"):
        base = base.get_base_model()
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or getattr(head, "weight", None) is None:
        return None
    return head if accepts_logits_to_keep(model) else None


@contextlib.contextmanager
def _head_returns_logprobs(head: torch.nn.Linear, index: torch.Tensor, labels: torch.Tensor,
                           temperature: float, chunk_rows: int):
    """While inside, `head`'s forward returns `gathered_logprobs` [M] of its output's rows (flattened) at
    `index` instead of the logits, `chunk_rows` rows of logits at a time, each chunk in an activation
    checkpoint; yields [number of calls]."""
    calls = [0]

    def logprobs(hidden: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        flat = hidden.reshape(-1, hidden.shape[-1])
        out, where = [], []
        for start in range(0, flat.shape[0], chunk_rows):
            sel = ((index >= start) & (index < start + chunk_rows)).nonzero().squeeze(-1)
            if len(sel):
                out.append(checkpoint(_chunk_logprobs, head, flat[start:start + chunk_rows],
                                      index[sel] - start, labels[sel], temperature, use_reentrant=False))
                where.append(sel)
        result = torch.zeros(len(index), dtype=torch.float32, device=flat.device)
        return result.index_copy(0, torch.cat(where), torch.cat(out)) if out else result

    # a wrapper set on the instance (e.g. accelerate's hooks) comes back after
    own = head.__dict__.get("forward")
    head.forward = logprobs
    try:
        yield calls
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _chunk_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """The head's weights used directly (calling the module would re-enter its hooks and the replaced
    forward); under ZeRO-3 they are gathered while the head's forward or backward runs."""
    return gathered_logprobs(F.linear(hidden, head.weight, head.bias).float(), rows, labels, temperature)


def _chunks_match(model, head, batch: dict, keep: torch.Tensor, temperature: float) -> bool:
    """Once per model: the chunked computation equals the whole-logits one on the first rows (module doc)."""
    base = unwrap_model(model)
    known = _chunking_ok.get(base)
    if known is not None:
        return known
    # row 0 of the batch; a batch with images runs whole (its image tensors are not split by row here)
    sub = batch if batch.get("image_inputs") else {
        k: v[:1] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch["input_ids"].shape[0]
        else v for k, v in batch.items()}
    cols = keep[-_CHECK_ROWS:]
    index = torch.arange(len(cols), device=keep.device)  # row 0's columns in the flattened rows
    with torch.no_grad():
        whole = _logits(model, sub, cols)[0]
        labels = whole.argmax(-1)
        want = gathered_logprobs(whole, index, labels, temperature)
        with _head_returns_logprobs(head, index, labels, temperature, chunk_rows=1):
            got = model(**model_inputs(model, sub), logits_to_keep=cols).logits.float().reshape(-1)
    ok = got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))
    _chunking_ok[base] = ok
    return ok


def forward_values(model, batch: dict) -> torch.Tensor:
    """Float32 per-token scalars [B, T] of a score model (reward model / critic, num_labels=1):
    the head applied to every position, before any pooling; of a context-parallel slice the whole row's
    [1, T_row] (`gather_replicated`: every rank computes the same loss from it). The trainer picks the
    positions it needs (e.g. `last_token_values`)."""
    base = unwrap_model(model)
    if hasattr(base, "peft_config"):
        base = base.get_base_model()
    head = getattr(base, "score", None)
    if head is None:
        raise ValueError(f"{type(base).__name__} has no `score` head; load it with load_score_model")
    captured = []
    hook = head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        with _running(model, batch):
            model(**model_inputs(model, batch))
    finally:
        hook.remove()
    values = captured[-1].squeeze(-1).float()
    return gather_replicated(values, batch["cp"].group) if "cp" in batch else values


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask → [B] index of each row's last 1 (works for left and right padding)."""
    mask = attention_mask.long()
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError("attention_mask has a row without any token")
    t = mask.shape[-1]
    return t - 1 - mask.flip(-1).argmax(-1)


def last_token_values(model, batch: dict) -> torch.Tensor:
    """Float32 [N]: a score model's value at each sequence's last real token (a reward): of a padded batch the
    last 1 of `attention_mask` (left or right padding; no mask: the last column), of a packed row or a
    context-parallel slice of one (`seq_lens`) each sample's end `cumsum(seq_lens) - 1` in the whole row."""
    values = forward_values(model, batch)
    if "seq_lens" in batch:
        ends = torch.as_tensor(batch["seq_lens"], device=values.device).cumsum(0) - 1
        return values[0, ends]
    if "attention_mask" not in batch:
        return values[:, -1]
    return values.gather(1, last_token_index(batch["attention_mask"])[:, None]).squeeze(1)


def next_token_logits(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_next_tokens(forward_logits(model, batch), batch)`."""
    return align_next_tokens(forward_logits(model, batch), batch)


def align_next_tokens(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`forward_logits(model, batch)` aligned with what they predict: (logits [B, L, V], labels [B, L]
    long, loss mask [B, L] float32), position t scoring the token after t. Padded / packed: the columns but
    the last, `input_ids[:, 1:]`, `loss_mask[:, 1:]`; a context-parallel slice: every column, its
    `cp_labels` (-100, where no target, as label 0 with mask 0)."""
    if "cp" in batch:
        mask = (batch["cp_labels"] != -100).float()
        return logits, batch["cp_labels"].clamp(min=0), mask
    return logits[:, :-1], batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:].float()


def sequence_logprobs(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample `(Σ_t m_t log π(x_t | x_<t), Σ_t m_t)` [N] over the loss-masked tokens of
    `forward_logits(model, batch)` (`align_next_tokens`): N rows of a padded batch, N = len(seq_lens) samples
    of a packed row; of a context-parallel slice this rank's share summed over its group (`group_sum`,
    differentiable; the counts detached)."""
    logits, labels, mask = align_next_tokens(logits, batch)
    logp = token_logprobs(logits, labels) * mask
    if "seq_lens" not in batch:
        return logp.sum(-1), mask.sum(-1)
    lens = torch.as_tensor(batch["seq_lens"], device=logp.device)
    if "cp" in batch:
        owner = batch["cp_owner"][0].clamp(min=0)  # padding's labels are masked: any owner
    else:  # the label at t+1 belongs to the sample of token t+1; one crossing a boundary has loss_mask 0
        owner = torch.repeat_interleave(torch.arange(len(lens), device=logp.device), lens)[1:]
    zeros = torch.zeros(len(lens), device=logp.device, dtype=logp.dtype)
    sums, counts = zeros.index_add(0, owner, logp[0]), zeros.index_add(0, owner, mask[0])
    if "cp" in batch:
        group = batch["cp"].group
        return group_sum(sums, group), group_sum(counts, group).detach()
    return sums, counts
