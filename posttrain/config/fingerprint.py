"""What makes checkpoints belong to a run: the fingerprint of its trajectory flags, and their folder.

`run_fingerprint(cfg) -> (digest, fields)`: `fields` maps every flag that decides the training
trajectory (dotted path, plus `trainer`) to its value, from `config_to_dict`; `digest` is the first
16 hex digits of the SHA-256 of their canonical JSON. Call it after `resolve_hardware_defaults`:
values resolved for the device count as used (`ds.param_dtype` auto is bf16 on GPU, fp32 on CPU), so
a GPU run resumed on CPU is refused by name (`--ds.param_dtype: checkpoint bf16, this run fp32`)
instead of silently changing precision. Each flag declares what a changed value means on resume
(`opt(..., on_resume=...)`); left out of the fingerprint are:
- volatile flags, which never change what is trained: `ckpt.*`, `logger.*` (W&B metadata included),
  `eval.*` (evaluation reads the model and never steps it), `data.dataloader_num_workers`, and the
  launcher flags `local_rank`, `use_ms`;
- adjustable flags (`adjustable_values(cfg)`), which a resumed run may change; the resume names each
  change in a start-up note:
  * run length, which a user may legitimately extend: `train.max_epochs` and `data.max_samples`
    (SFT/RM/DPO), `train.num_episodes`, `train.max_steps` and `data.max_samples` (PPO, where
    `train.max_epochs` is the number of passes over each rollout batch and so part of the trajectory);
  * execution: how the same steps are computed or placed, not what they compute — micro-batching
    and packing (the step loss is split-invariant, docs/algorithms.md), gradient checkpointing, attention
    and kernel backends, ZeRO stage/offload/partitioning, parallel sizes, vLLM engine settings, role
    placement, reward-server time-outs. An engine that cannot load the checkpoint says so on resume.

`checkpoint_dir(cfg)`: where this run's resumable checkpoints live — `--ckpt.path`, or when it is
unset `<--ckpt.output_dir>/checkpoints`; None when checkpoints are off (`--ckpt.disable_ds`, or
`--ckpt.path ''`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from posttrain.config.spec import flag_specs
from posttrain.config.trainers import TrainerConfig
from posttrain.config.yaml_io import config_to_dict

CHECKPOINTS_SUBDIR = "checkpoints"

def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _values(cfg: TrainerConfig) -> dict[str, Any]:
    """Dotted path -> value of every flag, `trainer` first."""
    return _flat(config_to_dict(cfg))


def _kinds(cfg: TrainerConfig) -> dict[str, str]:
    """Dotted path -> "trajectory" | "adjustable" | "volatile" (each flag's `on_resume`)."""
    return {spec.path: spec.on_resume for spec in flag_specs(type(cfg))}


def run_fingerprint(cfg: TrainerConfig) -> tuple[str, dict[str, Any]]:
    """(digest, fields) of the flags that decide the training trajectory (module docstring)."""
    kinds = _kinds(cfg)
    fields = {k: v for k, v in _values(cfg).items() if kinds.get(k, "trajectory") == "trajectory"}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], fields


def adjustable_values(cfg: TrainerConfig) -> dict[str, Any]:
    """Flags a resumed run may change (run length, execution): dotted path -> value."""
    kinds = _kinds(cfg)
    return {k: v for k, v in _values(cfg).items() if kinds.get(k) == "adjustable"}


def checkpoint_dir(cfg: TrainerConfig) -> Path | None:
    """`--ckpt.path`, or `<--ckpt.output_dir>/checkpoints` when it is unset; None when checkpoints
    are off (`--ckpt.disable_ds` or an empty `--ckpt.path`)."""
    c = cfg.ckpt
    if c.disable_ds or c.path == "":
        return None
    return Path(c.path) if c.path is not None else Path(c.output_dir) / CHECKPOINTS_SUBDIR
