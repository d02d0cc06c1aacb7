"""vLLM's LoRA support as the vLLM engine's ``adapter`` sync mode uses it: the engine arguments for one
adapter of a given rank, and an adapter written as the PEFT folder a ``LoRARequest`` loads."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch

from posttrain.models import lora_sync as lsync

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values


def vllm_lora_kwargs(rank: int) -> dict:
    """``vllm.LLM`` arguments for sampling with one LoRA adapter of this rank at a time."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora rank {rank}: vLLM supports LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return dict(enable_lora=True, max_lora_rank=fits[0], max_loras=1, max_cpu_loras=1)


def write_peft_adapter(folder: str, adapter: Mapping[str, torch.Tensor], rank: int, alpha: float) -> None:
    """A PEFT LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``, keys
    ``base_model.model.{module}.lora_A.weight``) from canonical adapter tensors."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    targets = sorted({lsync.adapter_module(n).rsplit(".", 1)[-1] for n in adapter})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=int(rank), lora_alpha=float(alpha),
                  lora_dropout=0.0, bias="none", target_modules=targets, fan_in_fan_out=False,
                  inference_mode=True)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file({f"base_model.model.{n}": t.contiguous() for n, t in adapter.items()},
              os.path.join(folder, "adapter_model.safetensors"))
