"""The train-engine interface shared by ``TorchEngine`` and ``DeepSpeedEngine``.

Training forwards go through ``engine.model`` (not ``engine.module``), then ``engine.backward(loss)``.
Gradient contract: the trainer gives each micro-batch a loss such that the step's loss is the SUM
of the micro-batch losses over all micro-batches and all ranks. ``backward(loss)`` accumulates;
``step()`` reduces across ranks so that the gradient equals the gradient of that sum (no hidden
``1/accumulation`` or ``1/world_size``), clips it to ``max_norm`` (global norm), steps the optimizer and
the scheduler, zeroes the gradients and returns the pre-clip gradient norm. Ranks may run different
numbers of micro-batches, except under ZeRO-2/3 which communicate inside every backward: there the
trainer pads to ``max_across_ranks(n)`` with zero-weighted micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from posttrain.engines import dist as pdist

STATE_META = "engine_state.json"


class TrainEngine:
    """Common distributed helpers; subclasses implement backward / step / state I/O."""

    module: torch.nn.Module
    rank: int = 0
    world_size: int = 1
    zero_stage: int | None = None

    @property
    def model(self) -> torch.nn.Module:
        """What training forwards must call (``engine.model(input_ids=...)``): under DeepSpeed the
        wrapper whose forward keeps ZeRO's micro-step bookkeeping; attribute access reaches the HF
        model. ``module`` is the unwrapped model, for saving, generation and evaluation."""
        return self.module

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    tensor_parallel: int = 1

    def layout(self) -> dict:
        """What an engine state depends on: the engine, its ranks, ZeRO stage and tensor-parallel size."""
        return {"engine": self.name, "world_size": self.world_size, "zero_stage": self.zero_stage,
                "tensor_parallel_size": self.tensor_parallel}

    def check_layout(self, directory: str, meta: dict) -> None:
        """ValueError when `directory`'s engine state (its `meta`, from `read_meta`) was written with another
        ZeRO stage, world size or tensor-parallel size than this engine's `layout` (a meta without a
        tensor-parallel size was written with none: 1)."""
        mine = self.layout()
        for key, missing in (("zero_stage", None), ("world_size", None), ("tensor_parallel_size", 1)):
            if meta.get(key, missing) != mine[key]:
                raise ValueError(f"{directory!r} was saved with {key}={meta.get(key)}, this run has "
                                 f"{key}={mine[key]}: an engine state resumes on the layout that wrote it")

    def set_global_step(self, step: int) -> None:
        raise NotImplementedError

    def save_layout_free(self, directory: str) -> None:
        """The layout-free copy of the state (`engines.portable`) beside the engine's own files (every rank);
        not for a tensor-parallel engine (its parameters are shards) or Muon (its state is not Adam's)."""
        from posttrain.engines.portable import save_portable, uses_adam

        if self.tensor_parallel == 1 and uses_adam(self):
            save_portable(self, directory)

    def load_other_layout(self, directory: str) -> bool:
        """When `directory` was written on another layout (ranks, ZeRO stage, engine), load its layout-free
        copy and say what changed; False when the layout is this engine's (the caller loads its own files)."""
        from posttrain.engines.portable import has_portable, load_portable
        from posttrain.utils.log import info

        saved, mine = saved_layout(directory), self.layout()
        if saved is None or saved == mine:
            return False
        was, now = describe_layout(saved), describe_layout(mine)
        if saved["tensor_parallel_size"] != 1 or mine["tensor_parallel_size"] != 1:
            raise ValueError(f"{directory!r} was written on {was}, this run is {now}: a tensor-parallel "
                             f"engine state resumes only on the layout that wrote it")
        if not has_portable(directory):
            raise ValueError(f"{directory!r} was written on {was}, this run is {now}, and it holds no "
                             f"layout-free copy (written by posttrain before elastic resume): resume on the "
                             f"layout that wrote it")
        load_portable(self, directory)
        if self.is_main:
            info(f"resumed {directory} written on {was} on {now}: weights, Adam moments and schedule from "
                 f"its layout-free copy (the same math; float sums may differ in the last bits)")
        return True

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def frozen_names(self) -> set[str]:
        """`state_dict` names of the frozen parameters (a LoRA model's base, tied copies included):
        checkpoints leave them out, and record `frozen_hash` instead."""
        return {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def frozen_hash(self) -> str:
        """`weights_hash` of the frozen tensors (computed once: they never change)."""
        if getattr(self, "_frozen_hash", None) is None:
            from posttrain.utils.weights_hash import weights_hash

            frozen = self.frozen_names()
            self._frozen_hash = weights_hash((k, v) for k, v in self.module.state_dict().items()
                                             if k in frozen)
        return self._frozen_hash

    def check_frozen(self, directory: str, meta: dict) -> None:
        """Refuse a trainable-only checkpoint whose frozen weights were not this model's."""
        if meta.get("frozen_hash") not in (None, self.frozen_hash()):
            raise ValueError(f"{directory!r} was trained on other frozen (base) weights than this model's: "
                             "load it over the base model it was saved with")

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> float:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        """Current LR of the first param group."""
        raise NotImplementedError

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (restored by ``load_state``)."""
        raise NotImplementedError

    def save_state(self, directory: str) -> None:
        raise NotImplementedError

    def load_state(self, directory: str) -> None:
        raise NotImplementedError

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def eval(self) -> None:
        self.module.eval()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce across ranks (``op`` sum / max / min); identity in one process."""
        return pdist.all_reduce(tensor, op)

    def max_across_ranks(self, value: int) -> int:
        """Max of an int over ranks (e.g. micro-batches this step, for padding under ZeRO-3)."""
        return int(self.all_reduce(torch.tensor([int(value)], dtype=torch.long), "max").item())

    def barrier(self) -> None:
        if pdist.is_distributed():
            dist.barrier()

    def gathered(self, tensors: Iterable[torch.Tensor]) -> contextlib.AbstractContextManager:
        """Context in which ``tensors`` (parameters or buffers of ``module``) hold their full values on
        every rank: collective under ZeRO-3 (every rank enters it with the same tensors), else nothing
        to do."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[torch.nn.Module]:
        """Context in which ``module`` holds full weights on every rank (a no-op except under ZeRO-3)."""
        with self.gathered(list(self.module.parameters())):
            yield self.module

    @contextlib.contextmanager
    def gathered_for_generation(self) -> Iterator[torch.nn.Module]:
        """``gathered_parameters`` that stays whole across forwards, for a generation loop: gathered once
        on entry, re-sharded once on exit (a no-op except under ZeRO-3; collective; read-only)."""
        with self.gathered_parameters() as module:
            yield module

    def full_weights(self, per_tensor: bool = False,
                     keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full-weight CPU copy)`` for every entry of ``module.state_dict()`` (those whose name
        ``keep`` accepts: only they are gathered), in its order, on rank 0; nothing on the other ranks,
        but every rank must exhaust the iterator (collective under ZeRO-3). Gathered all at once
        (``per_tensor`` False: the whole model materialises on every rank while the iterator runs), or
        one tensor at a time (no rank holds more than one full tensor)."""
        state = self.module.state_dict(keep_vars=True)
        if keep is not None:
            state = {name: tensor for name, tensor in state.items() if keep(name)}
        whole = list(state.values()) if keep is not None else list(self.module.parameters())
        with contextlib.nullcontext() if per_tensor else self.gathered(whole):
            for name, tensor in state.items():
                with self.gathered([tensor]) if per_tensor else contextlib.nullcontext():
                    if self.is_main:
                        yield name, tensor.detach().to("cpu", copy=True)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full-weight CPU state dict on rank 0 (``None`` on other ranks); collective under ZeRO-3."""
        state = dict(self.full_weights())
        return state if self.is_main else None


def write_meta(directory: str, meta: dict) -> None:
    with open(os.path.join(directory, STATE_META), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def saved_layout(directory: str) -> dict | None:
    """The layout an engine state was written with ({"engine", "world_size", "zero_stage",
    "tensor_parallel_size"}), or None when its meta is missing or unreadable."""
    try:
        with open(os.path.join(directory, STATE_META)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return {"engine": meta.get("engine"), "world_size": meta.get("world_size", 1),
            "zero_stage": meta.get("zero_stage"), "tensor_parallel_size": meta.get("tensor_parallel_size", 1)}


def describe_layout(layout: dict) -> str:
    stage = layout.get("zero_stage")
    ranks = layout.get("world_size") or 1
    how = "one process" if layout.get("engine") == "torch" else f"ZeRO-{stage}"
    return f"{ranks} rank(s), {how}" + (f", tensor parallel {layout['tensor_parallel_size']}"
                                        if (layout.get("tensor_parallel_size") or 1) > 1 else "")


def read_meta(directory: str, engine: str) -> dict:
    """Read ``engine_state.json`` from ``directory``; raise a clear error if missing, corrupt or foreign."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"engine state directory {directory!r} does not exist")
    path = os.path.join(directory, STATE_META)
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path!r} is missing: {directory!r} is not a complete engine "
                                f"state") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r} is corrupt ({e}); the engine state cannot be loaded") from None
    if meta.get("engine") != engine:
        raise ValueError(f"{directory!r} holds a {meta.get('engine')!r} engine state, this is a {engine!r} "
                         f"engine")
    return meta
