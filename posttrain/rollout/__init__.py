"""Rollout engines: token-in, token-out sampling for RL, one interface over two backends.

- ``SamplingParams``, ``RolloutOutput``, ``RolloutEngine`` (protocol), ``rank_seed`` (``types.py``).
- ``HFRolloutEngine`` (``hf_engine.py``): the training module itself, batched with left padding,
  a KV cache and our own sampling loop (CPU or GPU, any transformers causal LM); continuous
  batching: sequences join and leave the running decode batch (``decode_batch.py``), and
  ``stream()`` serves requests from other threads (``stream.py``, used by ``async_engine.py``).
- ``VLLMRolloutEngine`` (``vllm_engine.py``; the CPU build's settings in ``vllm_cpu.py``): vLLM's offline
  ``LLM`` (imported lazily); ``convert_vllm_outputs`` is the pure conversion of its outputs.
- ``make_rollout_engine(kind="hf" | "vllm", ...)``, and ``build_rollout_engine(cfg, ...)``: an RL run's
  engine from its config, built in this one place for the one-process trainer and the Ray workers
  (``engine_builder.py``).

Contract: ``generate(prompt_token_ids, params)`` returns, per prompt, ``params.n`` outputs holding
the sampled token ids exactly as sampled (stop token included, nothing padded or rewritten), one
log-prob per token ``log softmax(logits / temperature)[token]`` over the full vocabulary
(computed by ``posttrain.algorithms.losses.token_logprobs``, so the trainer's recomputation on the
same weights matches), and ``finish_reason`` "stop" | "length".
"""
from posttrain.rollout.engine_builder import ROLLOUT_ENGINES, make_rollout_engine
from posttrain.rollout.hf_engine import HFRolloutEngine, resolve_eos_ids
from posttrain.rollout.sampling import sample_next
from posttrain.rollout.types import RolloutEngine, RolloutOutput, SamplingParams, rank_seed
from posttrain.rollout.vllm_engine import VLLMRolloutEngine, convert_vllm_outputs

__all__ = [
    "ROLLOUT_ENGINES", "HFRolloutEngine", "RolloutEngine", "RolloutOutput", "SamplingParams",
    "VLLMRolloutEngine", "convert_vllm_outputs", "make_rollout_engine", "rank_seed", "resolve_eos_ids",
    "sample_next",
]
