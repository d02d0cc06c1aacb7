"""``DeepSpeedEngine``: DeepSpeed ZeRO stage 0-3 training (gloo on CPU, NCCL on GPU).

DeepSpeed is imported only when this engine is built. How the gradient-sum contract of
``posttrain.engines.base`` is met with DeepSpeed 0.19:
- ``managed_gradient_accumulation: false`` + ``gradient_accumulation_steps: 1``: every ``step()`` is
  the accumulation boundary, whatever the number of backwards before it (dynamic batching), and
  ``backward(..., scale_wrt_gas=False)`` adds no ``1/accumulation`` factor;
- DeepSpeed averages gradients over data-parallel ranks, so each loss is multiplied by their number (the
  world size; with tensor parallelism, the number of tensor-parallel groups) before backward (exact for
  power-of-two sizes);
- clipping: ZeRO 1-3 / bf16 clip with DeepSpeed's global norm (``gradient_clipping``); ZeRO-0 fp32
  passes the torch optimizer through unwrapped, so a step pre-hook clips the (already reduced,
  replicated) gradients and records the pre-clip norm (with tensor parallelism, the norm of
  `models.tensor_parallel.grad_norm`).
The optimizer is a client optimizer (torch AdamW, or DeepSpeed's Muon-with-aux-Adam which ZeRO
partitions correctly), so no DeepSpeed C++/CUDA op has to be built. With Muon under ZeRO 1-3,
DeepSpeed orthogonalizes the Muon matrices' gradients before it measures the norm, so the returned
norm (and the clipping) then covers the Muon update, not the raw gradient; its first step compiles
the Newton-Schulz kernel (about 30 s on CPU).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from posttrain.config.sections import PARAM_DTYPES, DSConfig, OptimizerFields
from posttrain.engines import dist as pdist
from posttrain.engines.base import TrainEngine, read_meta, write_meta
from posttrain.engines.optim import param_groups
from posttrain.engines.schedulers import build_scheduler, schedule_of
from posttrain.engines.zero3_step import lean_step
from posttrain.models import tensor_parallel as tp
from posttrain.models.moe import mark_zero3_leaves
from posttrain.utils.extras import require
from posttrain.utils.log import info

TAG = "engine"

GRAD_ACCUM_DTYPES = (None, "fp32", "bf16", "fp16")
# most gradient elements reduced per bucket under ZeRO-2/3 (200 MB in fp32)
REDUCE_BUCKET_ELEMENTS = 50_000_000
# ZeRO-3: most parameter elements a rank holds gathered at once (`stage3_max_live_parameters`) and the
# distance (in elements fetched) within which a gathered parameter is kept for its next use
# (`stage3_max_reuse_distance`): both 1/8 of the model, between these bounds. DeepSpeed's defaults, 1e9 (the
# upper bound), exceed any model below 1B parameters: once DeepSpeed had traced a step, every gathered
# parameter was kept until its next use, so each rank held the whole model gathered at the turn from forward
# to backward, and a frozen model's ranks held it between forwards (bench/RESULTS.md, issue 30). Both limits
# are needed: the first bounds the prefetch, the second lets a used parameter go.
LIVE_PARAMETERS_MIN, LIVE_PARAMETERS_MAX = 10_000_000, 1_000_000_000
_GENERATION = "posttrain.gathered_for_generation"  # marks ZeRO-3 parameters held by a generation


def live_parameters(model_numel: int) -> int:
    """`stage3_max_live_parameters` and `stage3_max_reuse_distance` for a model of `model_numel` elements:
    numel / 8 within the bounds above."""
    return min(LIVE_PARAMETERS_MAX, max(LIVE_PARAMETERS_MIN, model_numel // 8))


def import_deepspeed():
    """Import deepspeed with the CPU accelerator selected when there is no GPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    require("the DeepSpeed ZeRO engine", "deepspeed")
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


def start_process_group() -> None:
    """DeepSpeed's process group over the launcher's ranks (gloo on CPU, NCCL on GPU); one process: an
    in-memory rendezvous; a group already formed (a Ray role's ranks) is used as it is. Idempotent."""
    deepspeed = import_deepspeed()
    pdist.ensure_single_process_env()
    backend = pdist.default_backend()
    if backend == "nccl":
        torch.cuda.set_device(pdist.env_world()[2])
    if pdist.env_world()[1] == 1:
        pdist.start_single_process_group(backend)
    # a group already running (Ray's ranks, one process): used
    deepspeed.init_distributed(dist_backend=backend)


def ds_config(*, zero_stage: int, world_size: int, max_norm: float, param_dtype: str = "fp32",
              adam_offload: bool = False, grad_accum_dtype: str | None = None, zpg: int = 1,
              overlap_comm: bool = False, clip_in_deepspeed: bool = True, muon: bool = False,
              trainable: int | None = None, model_numel: int | None = None, tensor_parallel: int = 1) -> dict:
    """The DeepSpeed config dict (validated arguments; see the module docstring for the choices).
    `trainable`: the model's trainable elements; the gradient reduce bucket (ZeRO-2/3), which DeepSpeed
    allocates whole on every rank, holds 1/8 of them, at least 1e6 and at most `REDUCE_BUCKET_ELEMENTS`
    (DeepSpeed's default, 5e8, is a 1.9 GB fp32 buffer; a bucket as large as the gradient doubled a small
    model's gradient memory per rank). `model_numel`: the whole model's elements; under ZeRO-3 a rank
    holds at most `live_parameters(model_numel)` of them gathered. `tensor_parallel` > 1: AutoTP splits the
    model over groups of that many consecutive ranks (`models.tensor_parallel`; ZeRO 0/1/2)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {', '.join(PARAM_DTYPES)}, got {param_dtype!r}")
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"grad_accum_dtype must be one of None, fp32, bf16, fp16, got {grad_accum_dtype!r}")
    if overlap_comm and zero_stage < 2:
        raise ValueError("overlap_comm needs zero_stage 2 or 3 (DeepSpeed's unmanaged accumulation)")
    if adam_offload and zero_stage == 0:
        raise ValueError("adam_offload needs zero_stage 1, 2 or 3")
    if zpg < 1:
        raise ValueError(f"zpg must be >= 1, got {zpg}")
    if zpg > 1 and zero_stage != 3:
        raise ValueError("zpg (ZeRO++ hierarchical partitioning) needs zero_stage 3")
    if tensor_parallel > 1 and (zero_stage == 3 or world_size % tensor_parallel):
        raise ValueError(f"tensor_parallel {tensor_parallel} needs zero_stage 0-2 and to divide {world_size} "
                         f"ranks")
    zero: dict = {"stage": zero_stage, "overlap_comm": overlap_comm, "contiguous_gradients": zero_stage >= 2}
    if zero_stage >= 2:
        zero["reduce_bucket_size"] = min(REDUCE_BUCKET_ELEMENTS,
                                         max((trainable or 8 * REDUCE_BUCKET_ELEMENTS) // 8, 1_000_000))
    if zero_stage == 3 and model_numel is not None:
        zero["stage3_max_live_parameters"] = zero["stage3_max_reuse_distance"] = live_parameters(model_numel)
    if muon:  # DeepSpeed's Muon needs whole-gradient reduction (it orthogonalizes full matrices)
        zero["reduce_scatter"] = False
    if adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if zpg > 1:
        zero["zero_hpz_partition_size"] = zpg
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max_norm if clip_in_deepspeed and max_norm > 0 else 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10 ** 12,
        "wall_clock_breakdown": False,
    }
    if param_dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif param_dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 1000}
    if grad_accum_dtype is not None:
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    if tensor_parallel > 1:
        cfg["tensor_parallel"] = tp.autotp_config(tensor_parallel)
    return cfg


def numel(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """The model's parameter elements, whole (`ds_numel`) when they are ZeRO-3 shards."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad
               or not trainable_only)


class DeepSpeedEngine(TrainEngine):
    """``deepspeed.initialize`` around ``model`` with the gradient-sum contract (module docstring)."""

    name = "deepspeed"

    def __init__(self, model: torch.nn.Module, opt: OptimizerFields, *, total_steps: int, zero_stage: int = 2,
                 ds: DSConfig | None = None, tensor_parallel: int = 1):
        """`opt`: the optimizer section; `ds`: the `--ds.*` section (param_dtype, adam_offload,
        grad_accum_dtype, zpg, overlap_comm are read; default: DeepSpeed's defaults in fp32);
        `tensor_parallel`: ranks per model copy (`models.tensor_parallel`)."""
        ds = ds or DSConfig(param_dtype="fp32")
        param_dtype = ds.param_dtype or "fp32"
        max_norm, a = opt.max_norm, opt.adam
        schedule_of(opt, total_steps=total_steps)  # refuse a bad schedule before DeepSpeed starts
        if opt.optim == "muon" and (not opt.muon.nesterov or opt.muon.ns_steps != 5):
            raise ValueError("with DeepSpeed, Muon uses Nesterov momentum and 5 Newton-Schulz steps; "
                             "muon_nesterov=False / muon_ns_steps != 5 need the TorchEngine "
                             "(zero_stage=None)")
        self.zero_stage = zero_stage
        self._hook_clip = zero_stage == 0 and param_dtype == "fp32"
        self._ds = import_deepspeed()
        start_process_group()
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.max_norm = max_norm
        self.tensor_parallel = tensor_parallel
        self.dp_size = self.world_size // self.tensor_parallel  # ranks holding the same shard
        if self.tensor_parallel > 1:
            tp.check_modules(model, self.tensor_parallel)
        config = ds_config(zero_stage=zero_stage, world_size=self.world_size, max_norm=max_norm,
                           param_dtype=param_dtype, adam_offload=ds.adam_offload,
                           grad_accum_dtype=ds.grad_accum_dtype, zpg=ds.zpg, overlap_comm=ds.overlap_comm,
                           clip_in_deepspeed=not self._hook_clip, muon=opt.optim == "muon",
                           trainable=numel(model, trainable_only=True), model_numel=numel(model),
                           tensor_parallel=self.tensor_parallel)

        groups = param_groups(model, opt)
        if opt.optim == "muon":
            from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
            for g in groups:
                for p in g["params"]:
                    p.use_muon = g["use_muon"]
            for p in model.parameters():
                if not hasattr(p, "use_muon"):
                    p.use_muon = False
            optimizer = MuonWithAuxAdam([{k: v for k, v in g.items() if k not in ("nesterov", "ns_steps")}
                                         for g in groups])
        else:
            for g in groups:
                g.pop("use_muon")
            optimizer = torch.optim.AdamW(groups, lr=a.lr, betas=tuple(a.betas), eps=a.eps,
                                          weight_decay=a.weight_decay, fused=torch.cuda.is_available()
                                          or None)
        self._pre_clip_norm: float | None = None
        if self._hook_clip:
            optimizer.register_step_pre_hook(self._clip_hook)

        def scheduler(optimizer_):
            return build_scheduler(optimizer_, opt, total_steps=total_steps)

        if zero_stage == 3 and (leaves := mark_zero3_leaves(model)):  # gathered whole (models.moe)
            info(f"ZeRO-3 leaf modules (gathered whole, as routing varies): {', '.join(leaves)}")
        self.engine, self.optimizer, _, self.scheduler = self._ds.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        if zero_stage == 3:  # no second copy of the weights or the gradients at the step (zero3_step)
            lean_step(self.engine.optimizer)
        if self.tensor_parallel > 1:
            tp.check_split(self.engine.module)
            from deepspeed.utils import groups
            self.tensor_group = groups.get_tensor_model_parallel_group()  # DeepSpeed's: consecutive ranks

    def _clip_hook(self, optimizer, args: tuple, kwargs: dict) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if self.tensor_parallel > 1:  # split parameters' squares summed over the group, replicated ones once
            norm = tp.grad_norm(params, self.tensor_group)
            if self.max_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params,
                                                  self.max_norm if self.max_norm > 0 else float("inf"))
        self._pre_clip_norm = float(norm)

    @property
    def module(self) -> torch.nn.Module:  # the unwrapped HF model (partitioned under ZeRO-3)
        return self.engine.module

    @property
    def model(self) -> torch.nn.Module:
        """The DeepSpeed wrapper: its forward advances ZeRO's micro-step counter (ZeRO-3 would
        otherwise overwrite instead of accumulate the gradients of successive micro-batches) and
        registers the backward prologue."""
        return self.engine

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed averages each gradient over the ranks holding the same shard (all ranks; with tensor
        parallelism, one per group), so the loss is scaled by their number."""
        self.engine.backward(loss * self.dp_size, scale_wrt_gas=False)

    def step(self) -> float:
        self._pre_clip_norm = None
        self.engine.step()
        norm = self._pre_clip_norm if self._hook_clip else self.engine.get_global_grad_norm()
        if norm is None:
            raise RuntimeError("DeepSpeed did not report a gradient norm for this step")
        return float(norm)

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def global_step(self) -> int:
        return int(self.engine.global_steps)

    def set_global_step(self, step: int) -> None:
        self.engine.global_steps = step

    def gathered(self, tensors) -> contextlib.AbstractContextManager:
        """Under ZeRO-3, ``GatheredParameters`` over the partitioned ones among ``tensors`` (collective;
        read-only: changes made inside are dropped on exit); else nothing to do. Not with tensor parallelism
        (the shards would pass for whole weights): there `full_weights` gathers copies."""
        if self.tensor_parallel > 1:
            raise NotImplementedError("whole weights of a tensor-parallel model in place: use full_weights()")
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        return self._ds.zero.GatheredParameters(list(tensors), modifier_rank=None)

    @contextlib.contextmanager
    def gathered_for_generation(self) -> Iterator[torch.nn.Module]:
        """The base contract: whole weights across forwards, one gather on entry, one re-shard on exit.
        ZeRO-3's forward hooks would release each layer's weights after its forward, inside a
        ``GatheredParameters`` context too; so every parameter is marked in use by this context
        (``ds_active_sub_modules``, which ZeRO checks before it releases one) until the exit."""
        with self.gathered_parameters() as module:
            if self.zero_stage != 3:
                yield module
                return
            params = list(module.parameters())
            for p in params:
                p.ds_active_sub_modules.add(_GENERATION)
            try:
                yield module
            finally:
                for p in params:
                    p.ds_active_sub_modules.discard(_GENERATION)

    def full_weights(self, per_tensor: bool = False, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
        """The base contract; with tensor parallelism each split tensor is all-gathered over its group, one at
        a time (collective: every rank exhausts the iterator)."""
        if self.tensor_parallel == 1:
            yield from super().full_weights(per_tensor, keep)
            return
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if keep is None or keep(name):
                full = tp.full_tensor(self.module, name, tensor)
                if self.is_main:
                    yield name, full.detach().to("cpu", copy=True)

    def save_state(self, directory: str) -> None:
        """DeepSpeed checkpoint (weights, optimizer, scheduler) under tag ``engine``, then rank 0's meta;
        without the frozen parameters (a LoRA base) when the model has some."""
        frozen = bool(self.frozen_names())
        self.engine.save_checkpoint(directory, tag=TAG, save_latest=False, exclude_frozen_parameters=frozen)
        self.barrier()
        if self.is_main:
            tag_dir = os.path.join(directory, TAG)
            files = {f: os.path.getsize(os.path.join(tag_dir, f)) for f in sorted(os.listdir(tag_dir))}
            meta = {**self.layout(), "global_step": self.global_step, "files": files}
            if frozen:  # under ZeRO-3 the frozen weights are sharded: no hash of them
                meta.update(weights="trainable",
                            frozen_hash=self.frozen_hash() if self.zero_stage != 3 else None)
            write_meta(directory, meta)
        self.barrier()
        self.save_layout_free(directory)

    def load_state(self, directory: str) -> None:
        """Check the state is complete and matches this run (stage, world size), then load it all; a state
        written on another layout loads from its layout-free copy (`load_other_layout`)."""
        if self.load_other_layout(directory):
            return
        meta = read_meta(directory, self.name)
        self.check_layout(directory, meta)
        tag_dir = os.path.join(directory, TAG)
        for fname, size in meta["files"].items():
            path = os.path.join(tag_dir, fname)
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                raise ValueError(f"{path!r} is missing or truncated: {directory!r} is not a complete engine "
                                 f"state")
        trainable_only = meta.get("weights") == "trainable"
        if trainable_only and self.zero_stage != 3:
            self.check_frozen(directory, meta)
        load_path, _ = self.engine.load_checkpoint(directory, tag=TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True,
                                                   load_module_strict=not trainable_only)
        if load_path is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {directory!r}")
