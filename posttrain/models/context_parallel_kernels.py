"""The fused GPU kernel behind context-parallel attention (`models.context_parallel`): on CUDA in bf16/fp16,
torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`) replaces the masked sdpa.

The local queries of a packed row are cut into runs of one sample each (`query_runs`). A run holding the
queries at positions a..b-1 of its sample reads that sample's keys 0..b-1 from the gathered row, and causal
attention aligned at the bottom right (query i may read keys up to i + (b - a)) is exactly "a key of its own
sample at or before the query". A padding token (the row padded to a multiple of the group) is a run of its
own reading itself, as in the masked form. Same result as the masked sdpa up to float rounding, without the
[T_local, T] mask and with flash attention's memory.

`POSTTRAIN_CP_KERNEL=sdpa` keeps the masked sdpa everywhere (e.g. to compare)."""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QueryRuns:
    """Runs of local queries: run r is queries cu_q[r]:cu_q[r+1] of the slice, reading gathered-row keys
    `key_index[cu_k[r]:cu_k[r+1]]` (bottom-right causal)."""
    cu_q: torch.Tensor  # int32 [R + 1]
    cu_k: torch.Tensor  # int32 [R + 1]
    key_index: torch.Tensor  # long [cu_k[-1]]
    max_q: int
    max_k: int


def query_runs(q_sample: torch.Tensor, q_index: torch.Tensor, sample: torch.Tensor) -> QueryRuns:
    """`q_sample` / `q_index` [T_local]: each local query's sample (-1: padding) and its index in the row;
    `sample` [T]: every row token's sample. Runs end where the sample changes; each padding token is one."""
    qs, qi, row = q_sample.tolist(), q_index.tolist(), sample.tolist()
    first: dict[int, int] = {}
    for j, s in enumerate(row):
        first.setdefault(s, j)
    cu_q, cu_k, keys = [0], [0], []
    start = 0
    for t in range(1, len(qs) + 1):
        if t < len(qs) and qs[t] == qs[start] and qs[start] != -1:
            continue
        last = qi[t - 1]
        begin = first[qs[start]] if qs[start] != -1 else qi[start]
        keys.append(torch.arange(begin, last + 1))
        cu_q.append(t)
        cu_k.append(cu_k[-1] + last + 1 - begin)
        start = t
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    k_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
    device = q_index.device
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return QueryRuns(as_int(cu_q), as_int(cu_k), torch.cat(keys).to(device), max(q_lens), max(k_lens))


def fused_available(query: torch.Tensor) -> bool:
    """The varlen flash kernel applies: CUDA, half precision, one packed row, flash attention built in."""
    if os.environ.get("POSTTRAIN_CP_KERNEL", "") == "sdpa":
        return False
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and query.shape[0] == 1):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.backends.cuda.is_flash_attention_available()


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, runs: QueryRuns,
                     scale: float | None) -> torch.Tensor:
    """query [1, H, T_local, D], key / value of the whole row [1, H_kv, T, D] → [1, H, T_local, D]."""
    from torch.nn.attention.varlen import varlen_attn

    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).index_select(0, runs.key_index)
    v = value[0].transpose(0, 1).index_select(0, runs.key_index)
    takes = inspect.signature(varlen_attn).parameters  # torch 2.9-2.12: is_causal, no grouped heads
    options = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in takes:
            options["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = varlen_attn(q, k.contiguous(), v.contiguous(), runs.cu_q, runs.cu_k, runs.max_q, runs.max_k,
                      scale=scale, **options)
    return out.transpose(0, 1)[None]
