"""What a trainer needs for a vision-language model: its processor (the flags were checked against the model
at start-up: `inputs.model_rule_problems`)."""
from __future__ import annotations

from posttrain.models.vision import is_vision_folder, load_processor


def vision_processor(model_path, tokenizer):
    """The processor of a vision-language `model_path` (its rows may carry images), None for a text model."""
    return load_processor(model_path, tokenizer) if is_vision_folder(model_path) else None


def export_savers(tokenizer, processor) -> list:
    """What an exported model folder holds besides the weights (`save_pretrained`'s savers): the tokenizer, and a
    vision-language model's image processor (without it the folder does not load as a VLM again)."""
    return [tokenizer] if processor is None else [tokenizer, processor.image_processor]
