"""A frozen model beside the trained one in a single-model trainer: DPO's reference, KD's teacher.

- `load_frozen(cfg, path, what, offload, device, world_size)`: the model of `path`, frozen (eval mode, no
  gradients), built with the run's model settings (`ModelSetup.of(cfg)`: dtype, attention, context
  parallelism). With --ds.zero_stage 3 over several ranks it loads straight into ZeRO-3 shards and is
  returned as a `FrozenShards` (`engines.zero3`), whose forwards every rank runs together (the step loop pads
  ranks to the same number of micro-batches); `offload` then keeps the shards in CPU memory (on GPUs).
  Otherwise it sits on `device`, or on the CPU between forwards with `offload`.
- `frozen_logits(frozen, batch, offload, device)`: its float32 logits of a batch, without gradients.
"""
from __future__ import annotations

import torch

from posttrain.engines.zero3 import FrozenShards, describe_shards, sharded_loading
from posttrain.models import forward_logits
from posttrain.models.setup import ModelSetup
from posttrain.utils.log import info, rank_info


def load_frozen(cfg, path: str, what: str, *, offload: bool, device: torch.device, world_size: int = 1):
    """The frozen model of `path` (module doc); `what` names it in the start-up lines ("reference model")."""
    setup = ModelSetup.of(cfg)
    where = torch.device("cpu") if offload else device
    # with context parallelism the frozen model reads the same slices of each row as the trained one
    built = setup.build(path, "ref", device=where, sharding=sharded_loading(cfg.ds, cfg.ds.zero_stage),
                        split_rows=setup.ring > 1)
    if built.sharded:
        info(f"{what}: {path} (frozen, held as ZeRO-3 shards across the {world_size} ranks"
             f"{', shards in CPU memory' if offload and torch.cuda.is_available() else ''})")
        rank_info(describe_shards(what, built.model))
        return FrozenShards(built.model, cfg.ds, offload=offload)
    info(f"{what}: {path} (frozen, on {where}{' between forwards' if offload else ''})")
    return built.model


@torch.no_grad()
def frozen_logits(frozen, batch: dict, offload: bool = False, device=None) -> torch.Tensor:
    """Float32 logits of `frozen` (a model from `load_frozen`) for `batch`; `offload`: the model is moved to
    `device` for the forward and back to the CPU after it. ZeRO-3 shards: a collective forward."""
    if isinstance(frozen, FrozenShards):
        return forward_logits(frozen.module, batch)
    if offload:
        frozen.to(device)
    try:
        return forward_logits(frozen, batch)
    finally:
        if offload:
            frozen.to("cpu")
