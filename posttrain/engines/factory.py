"""``make_train_engine``: pick TorchEngine or DeepSpeedEngine and build optimizer + scheduler."""

from __future__ import annotations

import torch

from posttrain.engines.base import TrainEngine
from posttrain.engines.dist import env_world


def make_train_engine(model: torch.nn.Module, *, optim: str = "adam", lr: float, betas=(0.9, 0.95),
                      eps: float = 1e-8, weight_decay: float = 0.0, muon_lr: float = 0.02,
                      muon_momentum: float = 0.95, muon_nesterov: bool = True, muon_ns_steps: int = 5,
                      lr_scheduler: str = "cosine_with_min_lr", warmup_ratio: float = 0.03,
                      min_lr_ratio: float = 0.1, total_steps: int, max_norm: float = 1.0,
                      zero_stage: int | None = None, param_dtype: str = "fp32", adam_offload: bool = False,
                      grad_accum_dtype: str | None = None, zpg: int = 1, overlap_comm: bool = False) -> TrainEngine:
    """Train engine for ``model``.

    ``zero_stage=None`` → ``TorchEngine`` when ``WORLD_SIZE`` is unset or 1, else ``DeepSpeedEngine``
    with ZeRO-2; ``zero_stage`` 0..3 → ``DeepSpeedEngine`` with that stage. ``optim`` "adam" (AdamW, no
    decay on 1-D params) or "muon" (Muon on hidden matrices, AdamW at ``lr`` for the rest).
    """
    common = {"optim": optim, "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
              "muon_lr": muon_lr, "muon_momentum": muon_momentum, "muon_nesterov": muon_nesterov,
              "muon_ns_steps": muon_ns_steps, "lr_scheduler": lr_scheduler, "warmup_ratio": warmup_ratio,
              "min_lr_ratio": min_lr_ratio, "total_steps": total_steps, "max_norm": max_norm,
              "param_dtype": param_dtype}
    if zero_stage is None and env_world()[1] <= 1:
        set_flags = [name for name, is_set in (("adam_offload", adam_offload),
                                                ("grad_accum_dtype", grad_accum_dtype not in (None, "fp32")),
                                                ("zpg", zpg != 1), ("overlap_comm", overlap_comm)) if is_set]
        if set_flags:
            raise ValueError(f"{', '.join(set_flags)} need DeepSpeed: pass zero_stage=0..3")
        from posttrain.engines.torch_engine import TorchEngine
        return TorchEngine(model, **common)
    from posttrain.engines.deepspeed_engine import DeepSpeedEngine
    return DeepSpeedEngine(model, zero_stage=2 if zero_stage is None else zero_stage, adam_offload=adam_offload,
                           grad_accum_dtype=grad_accum_dtype, zpg=zpg, overlap_comm=overlap_comm, **common)
