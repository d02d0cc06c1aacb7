"""Models layer: tiny-model builder, loading (tokenizer, causal LM, score model), LoRA,
padded/packed forward passes, saving. Imports nothing above `posttrain.utils`.

The names below are imported on first use (`__getattr__`): importing one light module of this package
does not import the heavy ones (torch, transformers), so a user's mistake is reported before they load."""
from __future__ import annotations

from posttrain.utils.lazy_names import lazy_names

_WHERE = {  # name -> the module of this package that defines it
    "block_causal_mask": "forward", "forward_logits": "forward", "forward_logprobs": "forward",
    "forward_values": "forward", "model_inputs": "forward", "last_token_values": "forward",
    "next_token_logits": "forward", "sequence_logprobs": "forward", "check_model_folder": "folders",
    "check_model_path": "folders", "load_causal_lm": "loading", "load_score_model": "loading",
    "load_tokenizer": "loading", "parse_dtype": "loading", "LoraSpec": "lora", "apply_lora": "lora",
    "as_lora_spec": "lora", "is_peft": "lora", "lora_scalings": "lora", "tied_lora_layers": "lora",
    "trainable_names": "lora", "merge_lora": "merge", "atomic_output_dir": "saving",
    "save_pretrained": "saving", "unwrap_model": "saving", "ModelShape": "shapes", "SHAPES": "shapes",
    "PRESETS": "shapes", "build_tiny": "tiny", "model_config": "tiny",
}
__all__ = sorted(_WHERE)


__getattr__ = lazy_names(__name__, _WHERE)
