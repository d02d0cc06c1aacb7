"""``TorchEngine``: plain PyTorch training in one process (optionally data parallel over gloo/NCCL).

With several processes (``torchrun``), ``step()`` all-reduces (sums) every gradient before clipping,
so the gradient-sum contract of ``posttrain.engines.base`` holds; weights stay replicated because
every rank applies the same update. DeepSpeed is never imported here.
"""

from __future__ import annotations

import os

import torch

from posttrain.config.sections import OptimizerFields
from posttrain.engines import dist as pdist
from posttrain.engines.base import TrainEngine, read_meta, write_meta
from posttrain.engines.optim import build_optimizer
from posttrain.engines.schedulers import build_scheduler
from posttrain.utils.checkpoint import CheckpointError, load_state_file

_FILES = ("model.pt", "optimizer.pt", "scheduler.pt")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TorchEngine(TrainEngine):
    """AdamW / Muon + LR schedule + global-norm clipping around ``model`` (kept on its device), as the
    optimizer section `opt` says (`--optim`, `--adam.*`, `--muon.*`, `--lr_scheduler`, `--max_norm`, ...).

    ``param_dtype="bf16"`` casts the weights to bf16 (pure bf16, no fp32 master copy; use DeepSpeed
    for mixed precision). fp16 is not supported here (it needs loss scaling).
    """

    name = "torch"

    def __init__(self, model: torch.nn.Module, opt: OptimizerFields, *, total_steps: int,
                 param_dtype: str = "fp32"):
        if param_dtype not in _DTYPES:
            raise ValueError(f"TorchEngine param_dtype must be one of {', '.join(_DTYPES)}, got "
                             f"{param_dtype!r} (fp16 needs DeepSpeed's loss scaling: pass zero_stage=0..3)")
        pdist.init_process_group()
        self.rank, self.world_size, _ = pdist.env_world()
        if pdist.is_distributed():
            self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.module = model.to(_DTYPES[param_dtype]) if param_dtype != "fp32" else model
        if pdist.is_distributed():  # start every rank from rank 0's weights
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                torch.distributed.broadcast(t.data, src=0)
        self.max_norm = opt.max_norm
        self.optimizer = build_optimizer(self.module, opt)
        self.scheduler = build_scheduler(self.optimizer, opt, total_steps=total_steps)
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._steps = 0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        if pdist.is_distributed():
            for p in self._params:
                if p.grad is None:  # keep the collectives matched across ranks
                    p.grad = torch.zeros_like(p)
                pdist.all_reduce(p.grad, "sum")
        grads = [p for p in self._params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, self.max_norm if self.max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._steps += 1
        return float(norm)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def global_step(self) -> int:
        return self._steps

    def set_global_step(self, step: int) -> None:
        self._steps = step

    def save_state(self, directory: str) -> None:
        """Rank 0 writes model.pt, optimizer.pt, scheduler.pt, then engine_state.json; all ranks wait.
        A model with frozen parameters (LoRA) saves its trainable tensors only, with the frozen ones'
        hash in the meta."""
        if self.is_main:
            os.makedirs(directory, exist_ok=True)
            frozen = self.frozen_names()
            meta = {"engine": self.name, "global_step": self._steps, "world_size": self.world_size}
            if frozen:
                meta.update(weights="trainable", frozen_hash=self.frozen_hash())
            weights = {k: v for k, v in self.module.state_dict().items() if k not in frozen}
            torch.save(weights, os.path.join(directory, "model.pt"))
            torch.save(self.optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
            torch.save(self.scheduler.state_dict(), os.path.join(directory, "scheduler.pt"))
            write_meta(directory, meta)
        self.barrier()
        self.save_layout_free(directory)

    def load_state(self, directory: str) -> None:
        """Read and validate every file before changing anything; raise on a missing/corrupt state. A state
        written on another layout loads from its layout-free copy (`load_other_layout`)."""
        if self.load_other_layout(directory):
            return
        meta = read_meta(directory, self.name)
        loaded = {}
        for fname in _FILES:
            path = os.path.join(directory, fname)
            try:
                loaded[fname] = load_state_file(path)  # more than tensors: a one-line CheckpointError
            except CheckpointError:
                raise
            except FileNotFoundError:
                raise FileNotFoundError(f"{path!r} is missing: {directory!r} is not a complete engine "
                                        f"state") from None
            except Exception as e:  # truncated / not a torch file
                raise ValueError(f"{path!r} is corrupt: {e}") from e
        current = self.module.state_dict()
        weights = loaded["model.pt"]
        if meta.get("weights") == "trainable":  # the frozen base stays as loaded, if it is the same
            self.check_frozen(directory, meta)
            frozen = self.frozen_names()
            current = {k: v for k, v in current.items() if k not in frozen}
        if set(weights) != set(current):
            diff = sorted(set(weights) ^ set(current))[:5]
            raise ValueError(f"{directory}/model.pt does not match the model's parameters (e.g. {diff})")
        for k, v in weights.items():
            if v.shape != current[k].shape:
                raise ValueError(f"{directory}/model.pt: {k} has shape {tuple(v.shape)}, "
                                 f"the model has {tuple(current[k].shape)}")
        self.optimizer.load_state_dict(loaded["optimizer.pt"])
        self.scheduler.load_state_dict(loaded["scheduler.pt"])
        self.module.load_state_dict(weights, strict=len(weights) == len(self.module.state_dict()))
        self._steps = int(meta["global_step"])
