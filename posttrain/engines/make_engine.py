"""``make_train_engine``: pick TorchEngine or DeepSpeedEngine and build optimizer + scheduler."""

from __future__ import annotations

import torch

from posttrain.config.sections import DSConfig, OptimizerFields
from posttrain.engines.base import TrainEngine
from posttrain.engines.dist import env_world

_DEEPSPEED_ONLY = (("adam_offload", lambda ds: ds.adam_offload),
                   ("grad_accum_dtype", lambda ds: ds.grad_accum_dtype not in (None, "fp32")),
                   ("zpg", lambda ds: ds.zpg != 1), ("overlap_comm", lambda ds: ds.overlap_comm))


def make_train_engine(model: torch.nn.Module, opt: OptimizerFields, *, total_steps: int,
                      ds: DSConfig | None = None, zero_stage: int | None = None,
                      tensor_parallel: int = 1) -> TrainEngine:
    """Train engine for ``model`` with the optimizer section ``opt`` (``--optim``, ``--adam.*``, ``--muon.*``,
    ``--lr_scheduler``, ``--lr_warmup_ratio`` / ``--lr_warmup_steps``, ``--min_lr_ratio``, ``--max_norm``) and
    the ``--ds.*`` section ``ds`` (param_dtype; under ZeRO also adam_offload,
    grad_accum_dtype, zpg, overlap_comm).

    ``zero_stage=None`` → ``TorchEngine`` when ``WORLD_SIZE`` is unset or 1, else ``DeepSpeedEngine``
    with ZeRO-2; ``zero_stage`` 0..3 → ``DeepSpeedEngine`` with that stage. ``tensor_parallel`` > 1
    (DeepSpeed, ZeRO 0-2): the model split over groups of that many ranks (``models.tensor_parallel``).
    ``--optim`` adam (AdamW, no decay on 1-D params) or muon (Muon on hidden matrices, AdamW at ``--adam.lr``
    for the rest).
    """
    ds = ds or DSConfig(param_dtype="fp32")
    if zero_stage is None and env_world()[1] <= 1:
        set_flags = [name for name, is_set in _DEEPSPEED_ONLY if is_set(ds)]
        if set_flags:
            raise ValueError(f"{', '.join(set_flags)} need DeepSpeed: pass zero_stage=0..3")
        from posttrain.engines.torch_engine import TorchEngine
        return TorchEngine(model, opt, total_steps=total_steps, param_dtype=ds.param_dtype or "fp32")
    from posttrain.engines.deepspeed_engine import DeepSpeedEngine
    return DeepSpeedEngine(model, opt, total_steps=total_steps,
                           zero_stage=2 if zero_stage is None else zero_stage, ds=ds,
                           tensor_parallel=tensor_parallel)
