"""Hardware-dependent defaults and flags that cannot take effect on this machine.

`resolve_hardware_defaults` fills the "auto" defaults for the device the run uses (and replaces
settings that cannot work there); `inert_flags` lists the flags the user set that this run will
ignore, so the trainer can say so once at start-up. Call `inert_flags` before or after resolving: it
reads what the user asked for, which resolution records on the config."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from posttrain.config.spec import changed_values, flag_specs, get_path, set_path
from posttrain.config.values import format_value

_RESOLVED = "_posttrain_resolved"  # attribute on cfg: path -> (value asked for, value used, reason)


def _device_type(device: Any) -> str:
    return str(getattr(device, "type", device)).split(":")[0]


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolved_values(cfg) -> dict[str, tuple[Any, Any, str]]:
    """path -> (value asked for, value used, reason) for every value `resolve_hardware_defaults` set."""
    return dict(getattr(cfg, _RESOLVED, {}))


def _record(cfg, path: str, new: Any, reason: str) -> str:
    book = getattr(cfg, _RESOLVED, None)
    if book is None:
        book = {}
        object.__setattr__(cfg, _RESOLVED, book)
    old = get_path(cfg, path)
    book[path] = (book[path][0] if path in book else old, new, reason)
    set_path(cfg, path, new)
    asked = "auto" if old is None else format_value(old)
    return f"--{path}: {asked} -> {format_value(new)} ({reason})"


def resolve_hardware_defaults(cfg, device: Any) -> list[str]:
    """Resolve device-dependent settings in place; return one printable note per change.

    - `ds.param_dtype` unset -> bf16 on cuda, fp32 on cpu (bf16 matmuls are ~140x slower on CPU).
    - `ds.attn_implementation` unset -> flash_attention_2 on cuda when flash-attn is installed, else
      sdpa; a flash-attention backend asked for on CPU (or without flash-attn) -> sdpa.
    Idempotent: a second call changes nothing."""
    dev = _device_type(device)
    notes = []
    ds = cfg.ds
    if ds.param_dtype is None:
        notes.append(_record(cfg, "ds.param_dtype", "bf16" if dev == "cuda" else "fp32", f"auto for {dev}"))
    attn = ds.attn_implementation
    flash_ok = dev == "cuda" and _has("flash_attn")
    if attn is None:
        notes.append(
            _record(
                cfg,
                "ds.attn_implementation",
                "flash_attention_2" if flash_ok else "sdpa",
                f"auto for {dev}" + ("" if flash_ok or dev != "cuda" else " without flash-attn"),
            )
        )
    elif attn.startswith("flash_attention") and not flash_ok:
        why = "flash attention needs a CUDA GPU" if dev != "cuda" else "flash-attn is not installed"
        notes.append(_record(cfg, "ds.attn_implementation", "sdpa", why))
    return notes


# (flag path, predicate(value, cfg, dev, ray) -> inert?, reason)
_Rule = tuple[str, Callable[..., bool], str]


def _rules(cfg) -> list[_Rule]:
    on_cpu = lambda v, c, dev, ray: dev != "cuda"
    always = lambda v, c, dev, ray: True
    rules: list[_Rule] = [
        (
            "ds.ring_attn_size",
            always,
            "ring attention (sequence parallelism) is not implemented in posttrain",
        ),
        ("ds.ring_attn_head_stride", always, "ring attention is not implemented in posttrain"),
        ("ds.deepcompile", on_cpu, "DeepCompile needs a CUDA GPU"),
        (
            "ds.use_liger_kernel",
            lambda v, c, dev, ray: dev != "cuda" or not _has("liger_kernel"),
            "Liger kernels need a CUDA GPU and the liger-kernel package",
        ),
        (
            "ds.attn_implementation",
            lambda v, c, dev, ray: (
                str(v).startswith("flash_attention") and (dev != "cuda" or not _has("flash_attn"))
            ),
            "flash attention needs a CUDA GPU with flash-attn; sdpa is used",
        ),
        ("ds.adam_offload", on_cpu, "the optimizer state is already in CPU memory"),
        ("ds.tensor_parallel_size", on_cpu, "DeepSpeed AutoTP needs GPUs"),
        ("ds.zpg", on_cpu, "ZeRO++ partitioning needs GPUs"),
        ("ds.overlap_comm", on_cpu, "communication overlap needs GPU streams"),
        ("use_ms", always, "ModelScope downloads are not supported; pass a local folder or an HF hub id"),
    ]
    rules += [
        (f"logger.wandb.{name}", lambda v, c, dev, ray: c.logger.wandb.key is None, "W&B is off (no --logger.wandb.key)")
        for name in ("org", "group", "project", "run_name")
    ]
    if hasattr(cfg.ds, "enable_sleep"):
        rules.append(
            (
                "ds.enable_sleep",
                lambda v, c, dev, ray: dev != "cuda" or not ray,
                "sleep mode is for the GPU hybrid engine",
            )
        )
    if hasattr(cfg, "ref") and hasattr(cfg.ref, "offload"):
        rules.append(("ref.offload", on_cpu, "the reference model is already in CPU memory"))
    if cfg.trainer == "ppo":
        no_vllm = lambda v, c, dev, ray: dev != "cuda" or not ray or not _has("vllm")
        for spec in flag_specs(type(cfg)):
            if spec.section == "vllm":
                rules.append(
                    (
                        spec.path,
                        no_vllm,
                        (
                            "vLLM needs a CUDA GPU, Ray and the vllm package; "
                            "rollouts use the Hugging Face engine"
                        ),
                    )
                )
        rules.append(("reward.offload", on_cpu, "the reward model is already in CPU memory"))
        for name in ("lora.rank", "lora.alpha", "lora.dropout", "lora.target_modules", "load_in_4bit"):
            rules.append((f"ds.{name}", always, "posttrain ppo trains the full actor and critic (LoRA is for "
                                                "sft, rm and dpo; merge an adapter first with posttrain lora-merge)"))
        not_ray = lambda v, c, dev, ray: not ray
        for role in ("actor", "critic", "ref", "reward"):
            for name in ("num_nodes", "num_gpus_per_node"):
                rules.append((f"{role}.{name}", not_ray, "placement applies only to Ray runs"))
        for name in ("colocate_actor_ref", "colocate_critic_reward", "colocate_all"):
            rules.append((f"train.{name}", not_ray, "colocation applies only to Ray runs"))
        for name in ("temperature", "n_samples_per_prompt"):
            rules.append((f"eval.{name}", lambda v, c, dev, ray: not c.eval.dataset, "no --eval.dataset"))
    return rules


def inert_flags(cfg, device: Any, *, ray: bool = False) -> list[str]:
    """`--flag value: reason` for every flag set away from its default that has no effect in this run
    (on `device`, in-process unless `ray`). Flags still parse everywhere; this only reports them."""
    dev = _device_type(device)
    changed = changed_values(cfg)
    for path, (asked, _used, _why) in resolved_values(cfg).items():
        if asked is None:
            changed.pop(path, None)  # an auto default, not something the user set
        else:
            changed[path] = asked
    order = {s.path: i for i, s in enumerate(flag_specs(type(cfg)))}
    out = []
    for path, predicate, reason in sorted(_rules(cfg), key=lambda rule: order[rule[0]]):
        if path in changed and predicate(changed[path], cfg, dev, ray):
            value = changed[path]
            shown = "" if isinstance(value, bool) else " " + format_value(value)
            out.append((order[path], f"--{path}{shown} has no effect here: {reason}"))
    return [text for _, text in out]
