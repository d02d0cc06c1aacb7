"""Train engines: the optimizer / gradient / state side of training, behind one interface.

- ``TorchEngine`` (``torch_engine.py``): plain PyTorch, one process (or data parallel under torchrun);
  never imports DeepSpeed, so the embedded CPU default starts fast.
- ``DeepSpeedEngine`` (``deepspeed_engine.py``): DeepSpeed ZeRO stage 0-3, gloo on CPU, NCCL on GPU.
- ``make_train_engine(model, opt, *, total_steps, ds=None, zero_stage=None)`` (``make_engine.py``) picks
one; ``opt`` is
  an optimizer config section (``--optim``, ``--adam.*``, ``--muon.*``, ...), ``ds`` the ``--ds.*`` section.
- Optimisers (``optim.py``: AdamW without decay on 1-D params; Muon + auxiliary AdamW) and LR
  schedules (``schedulers.py``: cosine_with_min_lr, constant_with_warmup, linear).

Gradient contract (``base.py``): per micro-batch a forward through ``engine.model`` (under DeepSpeed
the wrapper that keeps ZeRO's bookkeeping; ``engine.module`` is the plain model for saving/eval)
and ``engine.backward(loss)``, where the step's loss is
the SUM of all micro-batch losses on all ranks; ``engine.step()`` reduces, clips to ``max_norm``,
updates, and returns the pre-clip grad norm. Under ZeRO-2/3 every rank must run the same number of
backwards per step: pad with zero-weighted micro-batches up to ``engine.max_across_ranks(n)``.

Launching several processes (each reads RANK / WORLD_SIZE / LOCAL_RANK from the launcher)::

    torchrun --nproc_per_node 2 -m posttrain.cli.train_sft --ds.zero_stage 2 ...      # CPU: gloo
    deepspeed --num_gpus 8 --module posttrain.cli.train_sft --ds.zero_stage 3 ...     # GPU: NCCL

On CPU, DeepSpeed runs with its CPU accelerator (``DS_ACCELERATOR=cpu`` is set when no GPU is
visible) and builds no ops (``DS_BUILD_OPS=0``); the first run JIT-compiles a small shared-memory
communication op, which takes about a minute once. Use fp32 on CPU.
"""

from posttrain.engines.base import TrainEngine
from posttrain.engines.make_engine import make_train_engine
from posttrain.engines.optim import MuonAdamW, build_optimizer, param_groups, param_roles
from posttrain.engines.schedulers import (
    SCHEDULERS,
    build_scheduler,
    lr_multiplier,
    num_warmup_steps,
    schedule_of,
)


def __getattr__(name):  # engines imported on demand (DeepSpeedEngine must not import deepspeed eagerly)
    if name == "TorchEngine":
        from posttrain.engines.torch_engine import TorchEngine
        return TorchEngine
    if name == "DeepSpeedEngine":
        from posttrain.engines.deepspeed_engine import DeepSpeedEngine
        return DeepSpeedEngine
    raise AttributeError(name)


__all__ = [
    "SCHEDULERS",
    "DeepSpeedEngine",
    "MuonAdamW",
    "TorchEngine",
    "TrainEngine",
    "build_optimizer",
    "build_scheduler",
    "lr_multiplier",
    "make_train_engine",
    "num_warmup_steps",
    "param_groups",
    "param_roles",
    "schedule_of",
]
