"""Trainer → rollout-engine weight sync: bucketed broadcast through a process group of its own
(actor rank 0 plus every engine; gloo on CPU, NCCL on GPU). The check that an engine holds exactly
the trainer's weights is `posttrain.utils.weights_hash`.

The group is built from a `TCPStore` rather than `init_process_group`, since each side already has
(or may have) a default group of its own (the actor's data-parallel ranks)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from posttrain.utils.weights_hash import NamedTensors, named_tensors


def sync_layout(state: NamedTensors, bucket_bytes: int) -> list[list[tuple[str, tuple, str]]]:
    """Buckets of `(name, shape, dtype)`, each at most `bucket_bytes` (a bigger tensor alone) and of
    one dtype, in the order of `state` (a state dict, or its pairs streamed one at a time) — the plan
    both ends of a broadcast follow."""
    buckets: list[list[tuple[str, tuple, str]]] = []
    size, dtype = 0, None
    for name, t in named_tensors(state):
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > bucket_bytes or str(t.dtype) != dtype:
            buckets.append([])
            size, dtype = 0, str(t.dtype)
        buckets[-1].append((name, tuple(t.shape), str(t.dtype)))
        size += nbytes
    return buckets


def layout_bytes(layout) -> int:
    """The bytes one broadcast of `layout` sends."""
    return sum(torch.Size(shape).numel() * _dtype(dtype).itemsize for bucket in layout
               for _, shape, dtype in bucket)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class SyncGroup:
    """Rank 0 sends, every other rank receives, one flat tensor per bucket."""

    def __init__(self, address: str, port: int, rank: int, world: int, backend: str = "gloo",
                 timeout_s: float = 600, store: dist.Store | None = None) -> None:
        """`store`: the group's rendezvous store when the caller has it (rank 0's `engines.dist.serve_store`,
        bound before its port was shared); else one is opened at `address:port` (served on rank 0)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
        store.set_timeout(timeout)
        self.store = store
        if backend == "nccl":
            self.group = dist.ProcessGroupNCCL(self.store, rank, world, dist.ProcessGroupNCCL.Options())
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world, timeout)
            self.device = torch.device("cpu")
        self.rank = rank

    def send(self, state: NamedTensors, layout) -> None:
        """Broadcast `state` bucket by bucket: it must hold exactly the layout's names in its order. Pairs
        streamed one at a time are consumed as the buckets go (at most one bucket's tensors are held)."""
        stream = iter(named_tensors(state))
        for bucket in layout:
            parts = []
            for name, _, _ in bucket:
                got, tensor = next(stream, (None, None))
                if got != name:
                    raise RuntimeError(f"weight sync: expected {name!r} next in the layout, got {got!r}")
                parts.append(tensor.detach().reshape(-1).to(self.device))
            self.group.broadcast(torch.cat(parts), 0).wait()
        extra = next(stream, None)
        if extra is not None:
            raise RuntimeError(f"weight sync: {extra[0]!r} is not in the layout")

    def receive(self, layout, load) -> None:
        """`load(named_tensors)` is called once per bucket with its `(name, tensor)` pairs."""
        for bucket in layout:
            numel = [int(torch.Size(shape).numel()) for _, shape, _ in bucket]
            flat = torch.empty(sum(numel), dtype=_dtype(bucket[0][2]), device=self.device)
            self.group.broadcast(flat, 0).wait()
            parts = flat.split(numel)
            load([(name, part.view(shape)) for (name, shape, _), part in zip(bucket, parts)])
