"""vLLM's CPU build: the engine settings it needs (`apply_cpu_defaults`) and the one line for its KV-cache
error (`kv_cache_too_small`). On a machine with CUDA both leave everything to vLLM."""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import torch

# the CPU build's KV cache when neither VLLM_CPU_KVCACHE_SPACE nor kv_cache_memory_bytes is set
CPU_KV_CACHE_GIB = 1


def apply_cpu_defaults(llm_kwargs: dict) -> None:
    """On a machine without CUDA (vLLM's CPU build): the engine core in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set: no second process per engine, and weight syncs reach the
    model without serialising it) unless tensor parallelism needs vLLM's worker processes, and a KV cache of
    ``CPU_KV_CACHE_GIB`` GiB (the CPU build otherwise sizes it from ``gpu_memory_utilization`` of the
    machine's RAM); ``VLLM_CPU_KVCACHE_SPACE`` (GiB) or ``kv_cache_memory_bytes`` set it.
    ``gpu_memory_utilization`` means nothing there and is dropped, and so is ``enable_sleep_mode`` (vLLM
    refuses it on CPU and ignores ``sleep`` there anyway). Chunked prefill is off unless set: when the prompts
    of one step pass its token budget (4096 on CPU), vLLM prefills a prompt in parts and rewinds a seeded
    request's generator after each part, which a CPU generator cannot do ("CPU Generator does not use
    offset": every seeded rollout of that size failed). Tensor parallelism: vLLM's worker processes (``mp``
    executor, gloo) with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless set (vLLM's ``auto`` binds each worker to
    a NUMA node of its own and refuses more workers than nodes). vLLM freezes its environment once an engine
    started in this process (``vllm.envs`` cache): the freeze is lifted so that a second engine
    reads these settings."""
    if torch.cuda.is_available():
        return
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    if int(llm_kwargs.get("tensor_parallel_size", 1) or 1) == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        llm_kwargs.setdefault("distributed_executor_backend", "mp")
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        llm_kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_GIB * 2**30)
    llm_kwargs.setdefault("enable_chunked_prefill", False)
    llm_kwargs.pop("gpu_memory_utilization", None)
    llm_kwargs.pop("enable_sleep_mode", None)


def kv_cache_too_small(err: BaseException, llm_kwargs: Mapping) -> str | None:
    """On vLLM's CPU build, the one line for vLLM's "KV cache cannot hold one max_model_len sequence" error
    (whose own advice, ``gpu_memory_utilization``, does nothing there); None for any other error."""
    text = str(err)
    if torch.cuda.is_available() or "KV cache" not in text or "max_model_len" not in text:
        return None
    size = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or llm_kwargs.get("kv_cache_memory_bytes", 0) / 2**30
    return (f"vLLM's CPU KV cache ({size} GiB) cannot hold one sequence of --data.max_len "
            f"{llm_kwargs.get('max_model_len')} tokens: set VLLM_CPU_KVCACHE_SPACE to more GiB (or lower "
            "--data.max_len)")
