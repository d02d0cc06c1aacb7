"""Fold a saved LoRA adapter into its base model: W ← W + (alpha / rank) B A."""
from __future__ import annotations

import json
import os

from posttrain.models.loading import check_model_path, load_causal_lm, load_score_model, load_tokenizer
from posttrain.models.saving import save_pretrained


def merge_lora(adapter_path, out_dir, base_path=None, dtype="fp32"):
    """Load the base (`base_path`, default: the adapter's `base_model_name_or_path`), apply the
    adapter saved at `adapter_path`, merge it and save a plain HF folder to `out_dir` with the
    adapter folder's tokenizer (the base's if the adapter folder has none). A reward-model
    adapter (peft task SEQ_CLS) merges into a score model. Returns the merged model."""
    from peft import PeftModel

    config_file = os.path.join(check_model_path(adapter_path), "adapter_config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"adapter_path {adapter_path}: no adapter_config.json (not a LoRA adapter folder)")
    with open(config_file) as f:
        adapter_cfg = json.load(f)
    base_path = base_path or adapter_cfg.get("base_model_name_or_path")
    if not base_path:
        raise ValueError(f"{config_file} names no base model; pass base_path")
    is_score = adapter_cfg.get("task_type") == "SEQ_CLS"
    base = (load_score_model if is_score else load_causal_lm)(base_path, dtype)
    merged = PeftModel.from_pretrained(base, adapter_path).merge_and_unload()
    has_tok = os.path.isfile(os.path.join(adapter_path, "tokenizer_config.json"))
    save_pretrained(merged, load_tokenizer(adapter_path if has_tok else base_path), out_dir)
    return merged
