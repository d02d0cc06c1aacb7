"""Token ids and image tensors of samples with images (vision-language models).

The processor (the model's, `models.vision.load_processor`) expands each image placeholder of a rendered
text into that image's run of image tokens; this happens once, here, and the sample keeps the ids and the
processor's image tensors (numpy, so they travel between processes like the rest of a sample). A text is
built from segments (`sft_dataset.encode_segments`); a segment with k placeholders takes the next k images.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import DataError

# processor outputs that are not image tensors (ids and masks are rebuilt per batch)
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def image_placeholder(processor) -> str:
    """The token text a rendered prompt holds once per image (`<|image_pad|>` for Qwen-VL)."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str):
        raise DataError(f"the model's processor ({type(processor).__name__}) names no image token; this "
                        "vision-language family is not supported")
    return token


def encode_with_images(processor, text: str, images: Sequence, location: str = "an image prompt",
                       labels: Sequence[str] | None = None) -> tuple[list[int], dict[str, np.ndarray]]:
    """(token ids, image tensors) of `text`, whose placeholders (one per image, in order) the processor
    expands into image tokens; no tokenizer special tokens are added (the text carries them). A ValueError of
    the processor is a one-line DataError naming `location`: one about image tokens (their count in the text
    against the images, or against the ids) is a template / placeholder problem; any other is an image the
    processor refuses (e.g. Qwen-VL's aspect ratio of 200 or more), named with the images (`labels`, one per
    image, e.g. their references) and their sizes."""
    try:
        out = processor(text=[text], images=list(images), add_special_tokens=False, return_tensors="np")
    except ValueError as e:
        reason = " ".join(str(e).split())[:160]
        if "token" in reason.lower():
            token = image_placeholder(processor)
            raise DataError(f"{location}: the rendered text's image placeholders do not match its "
                            f"{len(images)} image(s) ({reason}). Fix the chat template so that it puts one "
                            f"{token} per image, or remove image tokens written in the text itself") from None
        names = labels if labels is not None and len(labels) == len(images) else ["image"] * len(images)
        which = "; ".join(f"{name} ({img.width}x{img.height} px)" for name, img in zip(names, images))
        fix = "Replace the image, or crop or pad it to a shape this model's processor reads"
        raise DataError(f"{location}, {which}: the model's processor refuses "
                        f"{'it' if len(images) == 1 else 'one of them'} ({reason}). {fix}") from None
    return ([int(t) for t in out["input_ids"][0]],
            {k: np.asarray(v) for k, v in out.items() if k not in _TEXT_KEYS})


def concat_image_inputs(parts: Sequence[dict | None]) -> dict[str, np.ndarray] | None:
    """Image tensors (of a sample's pieces, or of a batch's samples in row order) concatenated along dim 0 per
    key, skipping the parts without images; None when none has. Parts with other keys are a ValueError."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    keys = parts[0].keys()
    if any(p.keys() != keys for p in parts):
        raise ValueError(f"the image inputs have different keys: {sorted({k for p in parts for k in p})}")
    return {k: np.concatenate([np.asarray(p[k]) for p in parts]) for k in keys}


class ImageEncoder:
    """`encode(text)` for `encode_segments`: token ids of one segment, taking the next images for its
    placeholders; `image_inputs()` once all segments are encoded (and every image was placed)."""

    def __init__(self, tokenizer: Any, processor, images: Sequence, location: str,
                 labels: Sequence[str] | None = None) -> None:
        self.tokenizer, self.processor, self.images, self.location = tokenizer, processor, list(
            images), location
        self.labels = list(labels) if labels is not None and len(labels) == len(self.images) else None
        self.placeholder = image_placeholder(processor)
        self.used = 0
        self.parts: list[dict[str, np.ndarray]] = []

    def __call__(self, text: str) -> list[int]:
        k = text.count(self.placeholder)
        if k == 0:
            return self.tokenizer.encode(text, add_special_tokens=False)
        if self.used + k > len(self.images):
            raise DataError(f"{self.location}: the rendered text has more image placeholders than the row "
                            f"has images ({len(self.images)}); put one image per placeholder")
        labels = self.labels[self.used:self.used + k] if self.labels else None
        ids, tensors = encode_with_images(self.processor, text, self.images[self.used:self.used + k],
                                          self.location, labels)
        self.used += k
        self.parts.append(tensors)
        return ids

    def image_inputs(self) -> dict[str, np.ndarray] | None:
        if self.used != len(self.images):
            raise DataError(f"{self.location}: the rendered text placed {self.used} of the row's "
                            f"{len(self.images)} images; the chat template dropped image parts, or the "
                            f"prompt has too few placeholders")
        return concat_image_inputs(self.parts)
