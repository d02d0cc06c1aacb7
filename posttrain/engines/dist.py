"""Process-group helpers shared by the train engines (rank / world size from the launcher's env)."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def env_world() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (defaults 0, 1, 0)."""
    try:
        return (int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")),
                int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers: {e}") from None


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def ensure_single_process_env() -> None:
    """Fill the rendezvous env for a one-process group when no launcher set it."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


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
