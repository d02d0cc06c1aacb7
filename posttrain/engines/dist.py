"""Process-group helpers shared by the train engines (rank / world size from the launcher's env)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def env_world() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (defaults
    0, 1, 0)."""
    try:
        return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def ensure_single_process_env() -> None:
    """Fill the rank env for a one-process group when no launcher set it (DeepSpeed reads it)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def start_single_process_group(backend: str | None = None) -> None:
    """The default process group of a one-process run, rendezvousing in memory: no port to pick, so
    runs started side by side, or a stale MASTER_PORT, cannot collide on one (EADDRINUSE)."""
    if not dist.is_initialized():
        dist.init_process_group(backend or default_backend(), store=dist.HashStore(), rank=0, world_size=1)


def group_timeout() -> datetime.timedelta:
    """The collective and rendezvous timeout of a group formed here: DeepSpeed's default (10 minutes,
    `DEEPSPEED_TIMEOUT` minutes when set), as when DeepSpeed forms the group from a launcher's env."""
    return datetime.timedelta(minutes=int(os.environ.get("DEEPSPEED_TIMEOUT", "10")))


def serve_store(host: str, world: int, port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous store for a group of `world` processes, listening on every interface at `port`
    (0: one the OS assigns, `.port`; `host` is this node's address, for the store's own client). Bound at
    once: a port found free and bound later can be taken in between by any other process (EADDRINUSE)."""
    return dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False, timeout=group_timeout())


def connect_store(host: str, port: int, world: int) -> dist.TCPStore:
    """A client of rank 0's `serve_store` (retries until it answers, up to `group_timeout`)."""
    return dist.TCPStore(host, port, world, is_master=False, timeout=group_timeout())


def init_process_group_from_store(store: dist.Store, rank: int, world: int,
                                  backend: str | None = None) -> None:
    """Start the default process group of `world` ranks over `store` (`serve_store` on rank 0,
    `connect_store` elsewhere); the engines then find it running and use it. As DeepSpeed forms it: its
    timeout, and on NCCL the rank's device bound at once (eager start; later groups split from it)."""
    backend = backend or default_backend()
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(env_world()[2])
        kwargs["device_id"] = torch.device("cuda", env_world()[2])
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=group_timeout(),
                            **kwargs)


def init_process_group(backend: str | None = None) -> None:
    """Start the default process group from env if ``WORLD_SIZE > 1`` and none is running yet."""
    if dist.is_available() and not dist.is_initialized() and env_world()[1] > 1:
        backend = backend or default_backend()
        if backend == "nccl":
            torch.cuda.set_device(env_world()[2])
        dist.init_process_group(backend=backend)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """All-reduce ``tensor`` in place across ranks (``op`` in sum / max / min) and return it."""
    if op not in _OPS:
        raise ValueError(f"all_reduce op must be one of {', '.join(_OPS)}, got {op!r}")
    if not is_distributed():
        return tensor
    if dist.get_backend() == "nccl" and tensor.device.type != "cuda":
        on_device = tensor.to(f"cuda:{torch.cuda.current_device()}")
        dist.all_reduce(on_device, op=_OPS[op])
        tensor.copy_(on_device)
    else:
        dist.all_reduce(tensor, op=_OPS[op])
    return tensor


def shutdown() -> None:
    """End a multi-process run cleanly: wait for every rank, then destroy the process group, so no
    communication thread is still alive while the interpreter exits (an exit-time abort otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
