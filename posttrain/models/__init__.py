"""Models layer: tiny-model builder, loading (tokenizer, causal LM, score model), LoRA,
padded/packed forward passes, saving. Imports nothing above `posttrain.utils`."""
from posttrain.models.forward import (
    block_causal_mask,
    forward_logits,
    forward_logprobs,
    forward_values,
    model_inputs,
)
from posttrain.models.loading import (
    check_model_folder,
    check_model_path,
    load_causal_lm,
    load_score_model,
    load_tokenizer,
    parse_dtype,
)
from posttrain.models.lora import (
    LoraSpec,
    apply_lora,
    as_lora_spec,
    is_peft,
    lora_scalings,
    tied_lora_layers,
    trainable_names,
)
from posttrain.models.merge import merge_lora
from posttrain.models.saving import atomic_output_dir, save_pretrained, unwrap_model
from posttrain.models.shapes import SHAPES, ModelShape
from posttrain.models.tiny import PRESETS, build_tiny, model_config

__all__ = [
    "PRESETS", "SHAPES", "LoraSpec", "ModelShape", "apply_lora", "as_lora_spec", "atomic_output_dir",
    "block_causal_mask", "build_tiny", "check_model_folder", "check_model_path", "forward_logits", "forward_logprobs",
    "forward_values", "is_peft", "load_causal_lm", "load_score_model", "load_tokenizer", "lora_scalings", "merge_lora",
    "model_config", "model_inputs", "parse_dtype", "save_pretrained", "tied_lora_layers",
    "trainable_names", "unwrap_model",
]
