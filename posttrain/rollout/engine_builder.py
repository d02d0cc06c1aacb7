"""Building rollout engines: ``make_rollout_engine(kind, ...)`` picks a backend by name;
``build_rollout_engine(cfg, ...)`` is the one place an RL run's engine is built from its config (the
one-process trainer and every Ray engine worker call it), with the vLLM arguments that config gives."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from posttrain.data.images import max_images

if TYPE_CHECKING:
    from posttrain.config import PPOConfig

ROLLOUT_ENGINES = ("hf", "vllm")


def make_rollout_engine(kind: str = "hf", *args, **kwargs):
    """``kind="hf"`` → ``HFRolloutEngine(model, tokenizer_or_eos_ids, *, pad_token_id, batch_size)``;
    ``kind="vllm"`` → ``VLLMRolloutEngine(llm_or_model_path, eos_token_ids, **llm_kwargs)``."""
    if kind == "hf":
        from posttrain.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(*args, **kwargs)
    if kind == "vllm":
        from posttrain.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(*args, **kwargs)
    raise ValueError(f"rollout engine kind={kind!r}: valid values are {list(ROLLOUT_ENGINES)}")


def build_rollout_engine(cfg: PPOConfig, tokenizer, backend: str, model: torch.nn.Module | None = None, *,
                         shared: bool = False):
    """The rollout engine an RL run samples with. ``backend`` ("hf" or "vllm") is
    `config.backends.rollout_backend`'s choice, made in the process that runs the engine.

    * "vllm": vLLM loaded from --actor.model_name_or_path (`vllm_engine_kwargs`): the offline `vllm.LLM`,
      whose `uni` executor keeps the engine core in this process (weight updates reach the model without
      serialising it), or AsyncLLM, its engine core in a child process, where requests are added, aborted or
      paused while others run (`needs_async_vllm`). Its stop ids are the HF engine's default; ``model`` is not
      used.
    * "hf": posttrain's HF engine over ``model``.

    ``shared`` is where the one-process path and an engine of its own genuinely differ. True: ``model`` is
    the trained actor's module (one process, sync RL); the engine samples with the trainer's current weights
    and nothing is synced (a LoRA actor samples through its own peft module). False: the engine's own copy of
    the policy (a Ray engine worker, or the one-process async pipeline), which receives the actor's weights
    after each update (on Ray by broadcast collective or the object store, in one process by copy); a LoRA
    actor's adapter alone after the first sync, applied as --vllm.lora_sync says."""
    from posttrain.models import as_lora_spec

    spec = as_lora_spec(cfg.ds.lora)
    if backend == "hf":
        if model is None:
            raise ValueError("build_rollout_engine: the HF engine needs the model it samples with")
        own = {} if shared else {"lora": spec, "lora_sync": cfg.vllm.lora_sync}
        return make_rollout_engine("hf", model, tokenizer, pad_token_id=tokenizer.pad_token_id, **own)
    if backend != "vllm" or shared:
        raise ValueError(f"build_rollout_engine: backend={backend!r}, shared={shared}: valid are 'hf', or "
                         "'vllm' with an engine of its own")
    from posttrain.rollout.hf_engine import resolve_eos_ids
    from posttrain.rollout.vllm_async_engine import VLLMAsyncRolloutEngine
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    # LoRA only for a LoRA actor: the verified hash then includes the scaling
    lora = {"lora": spec, "lora_sync": cfg.vllm.lora_sync} if spec is not None else {}
    cls = VLLMAsyncRolloutEngine if needs_async_vllm(cfg) else VLLMRolloutEngine
    return cls(cfg.actor.model_name_or_path, eos_token_ids=resolve_eos_ids(tokenizer),
               **vllm_engine_kwargs(cfg), **lora)


def needs_async_vllm(cfg: PPOConfig) -> bool:
    """vLLM's AsyncLLM (`VLLMAsyncRolloutEngine`) where requests must be added, aborted or paused while others
    run: async RL (a weight sync may arrive mid-generation: partial rollout) and agent episodes (each model
    call its own request); else the offline `vllm.LLM`."""
    return bool(cfg.train.async_enable or cfg.train.agent_func_path or cfg.train.tool_path)


VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_engine_kwargs(cfg: PPOConfig) -> dict:
    """`vllm.LLM` arguments from the OpenRLHF flags: one rank in this process (`uni` executor), or with
    --vllm.tensor_parallel_size N > 1 N worker processes of vLLM's (`mp` executor: CPUs only,
    `placement.workers.build_vllm_engine`; the placement reserves the engine N bundles, this process takes the
    first); with an image limit N > 0 (`data.images.max_images`), `limit_mm_per_prompt={"image": N}` (the
    engine then reads the image pad ids from the model's config); `vllm_cpu.apply_cpu_defaults` drops
    gpu_memory_utilization on CPU; vLLM's sleep mode on a GPU when the engines sleep (`sleeps`)."""
    images, tp = max_images(cfg.data), cfg.vllm.engine_ranks
    return dict(tensor_parallel_size=tp, distributed_executor_backend="uni" if tp == 1 else "mp",
                gpu_memory_utilization=cfg.vllm.gpu_memory_utilization, enforce_eager=cfg.vllm.enforce_eager,
                enable_prefix_caching=cfg.vllm.enable_prefix_caching,
                dtype=VLLM_DTYPES.get(cfg.ds.param_dtype, "auto"), seed=cfg.train.seed,
                max_model_len=cfg.data.max_len, trust_remote_code=False,
                **({"limit_mm_per_prompt": {"image": images}} if images > 0 else {}),
                **({"enable_sleep_mode": True} if sleeps(cfg) and torch.cuda.is_available() else {}))


def sleeps(cfg: PPOConfig) -> bool:
    """Whether vLLM engines sleep between rollouts: --vllm.enable_sleep with --train.colocate_all (OpenRLHF
    turns the flag off without it; async refuses it); vLLM's own sleep mode on a GPU, posttrain's on CPU."""
    return bool(cfg.vllm.enable_sleep and cfg.train.colocate_all and not cfg.train.async_enable)
