"""``make_rollout_engine(kind, ...)``: pick the rollout backend by name."""
from __future__ import annotations

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
