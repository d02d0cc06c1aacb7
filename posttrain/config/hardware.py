"""Hardware-dependent defaults.

`resolve_hardware_defaults` fills the "auto" defaults for the device the run uses (and replaces
settings that cannot work there); `record_resolved` is how it (and validation, for auto defaults
such as `--actor.loss_agg`) records what was asked for and what is used, so the start-up summary
shows both and the reason."""

from __future__ import annotations

import glob
import os
import sys
from typing import Any

from posttrain.config.flag_values import format_value
from posttrain.config.spec import get_path, set_path
from posttrain.config.trainers import CommandConfig
from posttrain.utils.extras import installed


def device_type(device: Any = None) -> str:
    """"cpu" / "cuda" / ... of a torch.device or a device string; None → what torch sees here ("cpu" without
    importing torch where it cannot see a GPU: `no_gpu_here`)."""
    if device is None:
        if no_gpu_here():
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(getattr(device, "type", device)).split(":")[0]


def no_gpu_here() -> bool:
    """Whether torch certainly sees no CUDA / ROCm GPU here, known without importing it (0.9 s, so that a bad
    flag is reported at once): CUDA_VISIBLE_DEVICES hides every GPU, the machine is a Mac, or it is Linux
    with no GPU driver device (/dev/nvidia*, ROCm's /dev/kfd, WSL's /dev/dxg)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or sys.platform == "darwin":
        return True
    return sys.platform.startswith("linux") and not (glob.glob("/dev/nvidia*") or os.path.exists("/dev/kfd")
                                                     or os.path.exists("/dev/dxg"))


def resolved_values(cfg: CommandConfig) -> dict[str, tuple[Any, Any, str]]:
    """path -> (value asked for, value used, reason) for every value set by `record_resolved`."""
    return dict(cfg.resolved or {})


def record_resolved(cfg: CommandConfig, path: str, new: Any, reason: str) -> str:
    """Set `path` to `new` on `cfg`, remembering what was asked for and why (shown by `format_config`);
    returns the printable note."""
    book = cfg.resolved if cfg.resolved is not None else {}
    asked = book[path][0] if path in book else get_path(cfg, path)
    cfg.resolved = {**book, path: (asked, new, reason)}
    set_path(cfg, path, new)
    asked = "auto" if asked is None else format_value(asked)
    return f"--{path}: {asked} -> {format_value(new)} ({reason})"


def resolve_hardware_defaults(cfg: CommandConfig, device: Any) -> list[str]:
    """Resolve device-dependent settings in place; return one printable note per change.

    - `ds.param_dtype` unset -> bf16 on cuda, fp32 on cpu (bf16 matmuls are ~140x slower on CPU).
    - `ds.attn_implementation` unset -> flash_attention_2 on cuda when flash-attn is installed, else
      sdpa; a flash-attention backend asked for on CPU (or without flash-attn) -> sdpa.
    - `ds.shared_prefix` (PPO) -> off with an attention backend other than sdpa / eager (the shared-
      prefix layout needs an explicit [B, 1, T, T] mask).
    Idempotent: a second call changes nothing."""
    dev = device_type(device)
    notes = []
    ds = cfg.ds
    if ds.param_dtype is None:
        notes.append(
            record_resolved(cfg, "ds.param_dtype", "bf16" if dev == "cuda" else "fp32", f"auto for {dev}")
        )
    attn = ds.attn_implementation
    flash_ok = dev == "cuda" and installed("flash_attn")
    if attn is None:
        notes.append(
            record_resolved(
                cfg,
                "ds.attn_implementation",
                "flash_attention_2" if flash_ok else "sdpa",
                f"auto for {dev}" + ("" if flash_ok or dev != "cuda" else " without flash-attn"),
            )
        )
    elif attn.startswith("flash_attention") and not flash_ok:
        why = "flash attention needs a CUDA GPU" if dev != "cuda" else "flash-attn is not installed"
        notes.append(record_resolved(cfg, "ds.attn_implementation", "sdpa", why))
    if getattr(ds, "shared_prefix", False) and ds.attn_implementation not in ("sdpa", "eager"):
        notes.append(record_resolved(cfg, "ds.shared_prefix", False,
                                     f"{ds.attn_implementation} takes no explicit attention mask"))
    return notes
