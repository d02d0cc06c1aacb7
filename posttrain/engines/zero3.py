"""ZeRO-3 sharding of whole models: loading straight into shards, and frozen (inference-only) models
held as shards across a role's ranks.

- ``sharded_loading(ds, zero_stage)``: a context inside which ``from_pretrained`` (``models.load_*``)
  builds the model under ``deepspeed.zero.Init`` (transformers' DeepSpeed integration, switched on by a
  live ``HfDeepSpeedConfig``): every parameter is partitioned as it is created and the weights are
  scattered one module at a time, so no accelerator ever holds the whole model. Host memory: rank 0
  reads the whole checkpoint into CPU memory while it loads (transformers 5), the other ranks only its
  shapes; once loaded each rank keeps its 1/world shard. Active only with ``zero_stage == 3`` and
  several ranks (``WORLD_SIZE > 1``); otherwise nothing changes. A model loaded so must then be
  wrapped by a ZeRO-3 ``DeepSpeedEngine`` (trained) or a ``FrozenShards`` (frozen), whose hooks gather
  each layer's weights for its forward.
- ``FrozenShards(model, ds, offload)``: a DeepSpeed engine without optimizer around a frozen model, as
  OpenRLHF holds its reference and reward models under ZeRO-3; ``offload`` keeps the shards in CPU
  memory (DeepSpeed's ``offload_param``) where there is an accelerator. Its forwards are collective:
  every rank of the role must run the same number (``max_across_ranks`` to pad).
- ``shard_numel(model)``: (elements this rank holds, elements of the whole model).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from posttrain.config.sections import DSConfig
from posttrain.engines import dist as pdist
from posttrain.engines.base import TrainEngine
from posttrain.engines.deepspeed_engine import ds_config, import_deepspeed, numel, start_process_group
from posttrain.models.moe import mark_zero3_leaves
from posttrain.models.setup import shard_numel
from posttrain.utils.log import info
from posttrain.utils.memory import mmap_threshold, release_freed_memory, run_mmap_threshold


def zero3_active(zero_stage: int | None) -> bool:
    """Whether models of this process are sharded: ZeRO stage 3 over several ranks."""
    return zero_stage == 3 and pdist.env_world()[1] > 1


def zero3_config(ds: DSConfig | None, *, offload_params: bool = False,
                 model_numel: int | None = None) -> dict:
    """The DeepSpeed config of a ZeRO-3 model of this world (dtype and ZeRO++ partitioning from `ds`;
    `offload_params`: shards in CPU memory, only with an accelerator; `model_numel`: bounds the gathered
    parameters, `deepspeed_engine.live_parameters`)."""
    ds = ds or DSConfig(param_dtype="fp32")
    gpu = torch.cuda.is_available()
    config = ds_config(zero_stage=3, world_size=pdist.env_world()[1], max_norm=0.0,
                       param_dtype=ds.param_dtype or "fp32", zpg=ds.zpg if gpu else 1,
                       model_numel=model_numel)
    if offload_params and gpu:
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return config


@contextlib.contextmanager
def sharded_loading(ds: DSConfig | None, zero_stage: int | None, *,
                    offload_params: bool = False) -> Iterator[bool]:
    """Inside: models load straight into ZeRO-3 shards (module docstring); yields whether they do."""
    if not zero3_active(zero_stage):
        yield False
        return
    start_process_group()
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    # transformers keeps a weak reference
    live = HfDeepSpeedConfig(zero3_config(ds, offload_params=offload_params))
    mmap_threshold(_SMALL_MMAP)
    try:
        yield True
    finally:
        unset_hf_deepspeed_config()
        del live
        mmap_threshold(run_mmap_threshold() or _LARGE_MMAP)
        release_freed_memory()


# glibc: while a model is built under zero.Init, each module's whole tensors are allocated, broadcast and
# freed in turn; with glibc's rising default mmap threshold they stayed in the heap (~1.2 GB more peak per
# rank at 0.5B, bench/RESULTS.md): blocks from 128 KiB get their own mappings while loading.
_SMALL_MMAP, _LARGE_MMAP = 128 * 1024, 32 * 1024 * 1024  # glibc's initial and largest default threshold


def describe_shards(role: str, model: torch.nn.Module) -> str:
    own, full = shard_numel(model)
    return (f"{role}: loaded as ZeRO-3 shards: this rank holds {own / 1e6:.2f}M of {full / 1e6:.2f}M "
            f"parameters ({own / max(full, 1):.0%})")


class FrozenShards(TrainEngine):
    """A frozen model sharded over the role's ranks (ZeRO-3, no optimizer). Forwards go through
    ``module`` (ZeRO's hooks gather each layer for its forward, then release it); every rank must run
    as many forwards as the others."""

    name = "deepspeed-inference"
    zero_stage = 3

    def __init__(self, model: torch.nn.Module, ds: DSConfig | None = None, *, offload: bool = False) -> None:
        deepspeed = import_deepspeed()
        start_process_group()
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        model.requires_grad_(False)
        config = zero3_config(ds, offload_params=offload, model_numel=numel(model))
        config.pop("gradient_clipping", None)
        if leaves := mark_zero3_leaves(model):  # a mixture of experts' expert blocks are gathered whole
            info(f"ZeRO-3 leaf modules (gathered whole, as routing varies): {', '.join(leaves)}")
        self.engine, *_ = deepspeed.initialize(model=model, config=config)
        self.engine.eval()
        release_freed_memory()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def gathered(self, tensors) -> contextlib.AbstractContextManager:
        return import_deepspeed().zero.GatheredParameters(list(tensors), modifier_rank=None)
