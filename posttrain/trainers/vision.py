"""What a trainer needs for a vision-language model: its processor, and the flags checked against it."""
from __future__ import annotations

from posttrain.models.vision import is_vision_folder, load_processor
from posttrain.utils.errors import UserError


def vision_processor(model_path, tokenizer, max_images: int, packing: bool):
    """The processor of a vision-language `model_path` (its rows may carry images), None for a text model.
    Refuses (UserError) --data.max_images_per_prompt for a text model and --ds.packing_samples for a VLM."""
    if not is_vision_folder(model_path):
        if max_images:
            raise UserError(f"--data.max_images_per_prompt {max_images}: {model_path} is not a vision-language "
                            "model (its config has no vision part); drop the flag or train a vision-language model")
        return None
    if packing:
        raise UserError(f"--ds.packing_samples: {model_path} is a vision-language model, which trains on padded "
                        "batches (it computes its rotary positions per row from the image grid); drop the flag")
    return load_processor(model_path, tokenizer)


def export_savers(tokenizer, processor) -> list:
    """What an exported model folder holds besides the weights (`save_pretrained`'s savers): the tokenizer, and a
    vision-language model's image processor (without it the folder does not load as a VLM again)."""
    return [tokenizer] if processor is None else [tokenizer, processor.image_processor]
