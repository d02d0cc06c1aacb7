"""Vision-language models (VLMs): detection, the processor, the vision tower, and a batch's image inputs.

A model is a VLM when its config has a `vision_config` (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5, Gemma 3/4,
LLaVA-style ...); it loads through `AutoModelForImageTextToText` (`loading.load_causal_lm` picks it).

Token-in-token-out with images: the processor expands each image placeholder of a rendered prompt into the
image's run of image tokens once, when the data is read (`data.vision_samples.encode_with_images`); a sample
keeps those token ids and the processor's image tensors (`pixel_values`, `image_grid_thw` or the family's
equivalents), and every later pass feeds exactly them (`data.collate.merge_image_inputs` concatenates a
batch's samples along dim 0, in row order, the order in which the model matches image tokens to images).
"""
from __future__ import annotations

import functools
import inspect
import os

import torch

from posttrain.models.config_facts import (  # noqa: F401 (imported from here)
    is_vision_config,
    is_vision_folder,
)
from posttrain.models.saving import unwrap_model
from posttrain.utils.errors import UserError

# names whose parameters belong to the language model (everything else is the vision tower and its projector)
_LANGUAGE_PARTS = ("language_model", "lm_head")


def is_vision_model(model) -> bool:
    return is_vision_config(getattr(unwrap_model(model), "config", None))


def processor_chat_template(path) -> str | None:
    """The chat template the processor of the model at `path` loads (`chat_template.jinja`, or the legacy
    `chat_template.json`; of several named ones, "default"), the one OpenRLHF renders a VLM's prompts with;
    None where it has none or its files cannot be read."""
    from transformers.processing_utils import ProcessorMixin

    try:
        template = ProcessorMixin.get_processor_dict(str(path))[0].get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def load_processor(path, tokenizer=None):
    """The model's processor (image processor + tokenizer, with the chat template), from `path`.

    `AutoProcessor` first; where it cannot be built (a family whose processor also wants a video processor,
    which needs torchvision) the family's processor class is built from the image processor and the
    tokenizer alone, the parts a text-and-image model needs, with the processor's own chat template.
    `tokenizer` (`load_tokenizer`'s: the processor's chat template, or `--data.tokenizer_chat_template`)
    replaces the folder's own, and its chat template the processor's."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(str(path))
    except (ImportError, AttributeError, ValueError, TypeError, OSError):
        processor = None
    if processor is None or getattr(processor, "image_processor", None) is None:
        config = AutoConfig.from_pretrained(str(path))
        cls = _processor_class(config.model_type)
        parts = {name: None for name in cls.get_attributes()}
        parts["image_processor"] = _image_processor(AutoImageProcessor, str(path))
        parts["tokenizer"] = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(path))
        template = processor_chat_template(path) or parts["tokenizer"].chat_template
        processor = _without_missing_parts(cls)(**parts, chat_template=template)
    if tokenizer is not None:
        processor.tokenizer = tokenizer
        processor.chat_template = tokenizer.chat_template
    # as OpenRLHF's processor carries them
    for name in ("pad_token", "pad_token_id", "eos_token", "eos_token_id"):
        setattr(processor, name, getattr(processor.tokenizer, name))
    return processor


def _image_processor(auto_cls, path: str):
    """The image processor of `path`; UserError naming preprocessor_config.json when a local folder's is
    missing or does not load."""
    try:
        return auto_cls.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as err:
        if not os.path.isdir(path):
            raise
        file = os.path.join(path, "preprocessor_config.json")
        first = (str(err).strip().splitlines() or [""])[0][:200]
        what = (f"{file} cannot be read ({type(err).__name__}: {first})" if os.path.isfile(file)
                else f"vision-language model {path} has no preprocessor_config.json")
        raise UserError(f"{what}: the image processor is part of a vision-language model; copy "
                        "preprocessor_config.json from the model it was trained from") from None


def _processor_class(model_type: str):
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if name is None or not hasattr(transformers, name):
        raise ValueError(f"no processor is known for model type {model_type!r}: this transformers version "
                         f"cannot prepare its images; upgrade transformers or use a supported "
                         f"vision-language model")
    return getattr(transformers, name)


def _without_missing_parts(cls):
    """`cls` accepting None for a part it does not need here (its video processor)."""
    class Processor(cls):
        def check_argument_for_proper_class(self, argument_name, argument):
            return (None if argument is None
                    else super().check_argument_for_proper_class(argument_name, argument))

    Processor.__name__ = Processor.__qualname__ = cls.__name__
    return Processor


def config_token_id(config, kind: str) -> int | None:
    """A special token's id from an HF config (or its dict): `{kind}_token_id`, or `{kind}_token_index` (some
    families' spelling); None where the config has neither. `kind`: "image", "video",
    "vision_start", "boi" ..."""
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


def image_token_types(config, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] token types over a whole sequence (prompt and response): 1 at image tokens, 2 at video tokens,
    0 elsewhere; the model places its image features and its rotary positions by them."""
    types = torch.zeros_like(input_ids)
    for value, kind in ((1, "image"), (2, "video")):
        token = config_token_id(config, kind)
        if token is not None:
            types[input_ids == token] = value
    return types


def vision_forward_inputs(model, input_ids: torch.Tensor, images: dict[str, torch.Tensor]) -> dict:
    """The keyword arguments a VLM takes besides the ids and the mask: the image tensors and the token types,
    under the name the model's forward takes them by (`mm_token_type_ids`: Qwen-VL, Qwen3.5 and Gemma 4, whose
    rotary positions or bidirectional image attention read them; `token_type_ids`: Gemma 3, PaliGemma;
    neither: LLaVA-style models, which find the image tokens by id)."""
    if not images:
        return {}
    key = _token_types_name(model)
    if key is None:
        return dict(images)
    return {**images, key: image_token_types(unwrap_model(model).config, input_ids)}


def _token_types_name(model) -> str | None:
    base = unwrap_model(model)
    if callable(getattr(base, "get_base_model", None)):  # a peft wrapper: its forward passes keywords through
        base = base.get_base_model()
    return _forward_token_types_name(type(base))


@functools.cache
def _forward_token_types_name(cls) -> str | None:
    params = inspect.signature(cls.forward).parameters
    return next((name for name in ("mm_token_type_ids", "token_type_ids") if name in params), None)


def is_vision_tower_name(name: str) -> bool:
    """Whether a parameter name belongs to the vision tower or its projector (outside the language model)."""
    return not any(part in name for part in _LANGUAGE_PARTS)


def freeze_visual_encoder(model) -> int:
    """Freeze every parameter outside the language model (the vision tower and its projector); returns how
    many tensors were frozen."""
    frozen = 0
    for name, param in unwrap_model(model).named_parameters():
        if param.requires_grad and is_vision_tower_name(name):
            param.requires_grad_(False)
            frozen += 1
    return frozen


def vision_processor(model_path, tokenizer):
    """The processor of a vision-language `model_path` (its rows may carry images), None for a text model (the
    flags were checked against the model at start-up: `trainers.inputs.model_rule_problems`)."""
    return load_processor(model_path, tokenizer) if is_vision_folder(model_path) else None


def export_savers(tokenizer, processor) -> list:
    """What an exported model folder holds besides the weights (`save_pretrained`'s savers): the tokenizer,
    and a vision-language model's image processor (without it the folder does not load as a VLM again)."""
    return [tokenizer] if processor is None else [tokenizer, processor.image_processor]
