"""A tiny random-init Qwen2.5-VL (`posttrain init-tiny --vision`): a tiny preset's language model, a 2-block
vision tower, the project's tokenizer with the Qwen vision tokens added, and a Qwen2-VL image processor
bounded to small images (56x56 to 112x112 pixels: 4 to 16 image tokens per image). Saved as a plain HF
folder; `AutoModelForImageTextToText` and `models.vision.load_processor` load it like a released model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from posttrain.models.saving import atomic_output_dir
from posttrain.models.tiny_tokenizer import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    portable_tokenizer_class,
    train_tiny_tokenizer,
)

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                  "<|video_pad|>")
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END
PATCH, MERGE = 14, 2  # pixels per patch side; patches merged per side into one image token

# ChatML whose message content is text or a list of parts ({"type": "text", "text"} / {"type": "image"}).
VISION_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '" + IMAGE_PLACEHOLDER + "' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary frequencies into (time, height, width); it sums to head_dim / 2."""
    half = head_dim // 2
    side = (half - half // 4) // 2
    return [half - 2 * side, side, side]


def build_tiny_vision(out: Path, preset, seed: int,
                      max_position_embeddings: int) -> tuple[int, int, int, int]:
    """Write the tiny VLM into `out` (an empty or new folder, replaced atomically). Returns
    (parameters, vocabulary size, pad id, eos id)."""
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
    )

    tokenizer = train_tiny_tokenizer(2048, model_max_length=max_position_embeddings)
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, VISION_START, VISION_END, IMAGE_PAD,
                                                                VIDEO_PAD]})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    start, end, image, video, pad_id, eos_id = tokenizer.convert_tokens_to_ids(
        [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, PAD_TOKEN, IM_END])
    head_dim = preset.hidden_size // preset.num_attention_heads
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=preset.hidden_size, num_hidden_layers=preset.num_hidden_layers,
                         num_attention_heads=preset.num_attention_heads,
                         num_key_value_heads=preset.num_key_value_heads,
                         intermediate_size=preset.intermediate_size, vocab_size=len(tokenizer),
                         max_position_embeddings=max_position_embeddings,
                         rope_scaling={"type": "mrope", "mrope_section": _mrope_section(head_dim)},
                         tie_word_embeddings=True, initializer_range=0.02, pad_token_id=pad_id,
                         eos_token_id=eos_id, bos_token_id=None),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2,
                           out_hidden_size=preset.hidden_size, window_size=PATCH * MERGE * 2,
                           fullatt_block_indexes=[1], initializer_range=0.02),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=True, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                                               bos_token_id=None)
    side = PATCH * MERGE
    image_processor = Qwen2VLImageProcessor(min_pixels=side * side * 4, max_pixels=side * side * 16,
                                            patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2)
    with atomic_output_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        image_processor.save_pretrained(tmp)
        portable_tokenizer_class(tmp)
    return sum(t.numel() for t in model.parameters()), len(tokenizer), pad_id, eos_id
