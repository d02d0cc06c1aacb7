"""Prompt datasets for RL: each row becomes the prompt text the policy sees, its token ids, and
its label (ground truth for a verifiable reward, passed to `reward_func` as `labels`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .capping import cap_text_fields
from .errors import DataError, where
from .images import (
    DEFAULT_IMAGE_LIMITS,
    ImageLimits,
    check_image_count,
    count_image_parts,
    image_labels,
    row_image_refs,
    row_images,
    to_vision_messages,
)
from .templates import check_input_template, format_prompt, render_chat, to_messages
from .validation import get_field, require_text_or_messages
from .vision_samples import ImageEncoder


@dataclass
class Prompt:
    text: str
    token_ids: list[int]
    label: Any
    source: str
    image_inputs: dict | None = None  # the processor's image tensors (numpy) of a prompt with images
    images: list | None = None  # its images (PIL), for engines that take raw images (vLLM)
    image_refs: Any = None  # its image column as written (`row_image_refs`), what an agent executor gets
    columns: dict | None = None  # the row's other columns, for reward functions (`extra_columns`)
    messages: list | None = None  # a message-list row's chat messages (`extra_columns`): TRL's `prompts`


class PromptDataset:
    """`rows` → prompts. The input field is text or a message list; with `apply_chat_template` it is
    rendered with a generation prompt, else formatted by `input_template` (a `{}` template) or used
    as is. Prompts longer than `max_prompt_len` tokens (when given) are dropped and counted. With
    `extra_columns`, each prompt keeps its row's other columns (`row_columns`) and, for a message-list
    input under the chat template, its messages as rendered, for reward functions.
    `tools` (OpenAI function schemas) and `system_prompt` (a system turn put first unless the row has one)
    only apply under the chat template (a tool environment's prompts)."""

    def __init__(self, rows: list[dict], tokenizer, *, input_key: str = "input", label_key: str | None = None,
                 input_template: str | None = None, apply_chat_template: bool = False,
                 max_prompt_len: int | None = None, processor=None, image_key: str = "images",
                 max_images: int = 0, image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
                 extra_columns: bool = False, tools: list[dict] | None = None,
                 system_prompt: str | None = None) -> None:
        check_input_template(input_template)
        self.prompts: list[Prompt] = []
        self.dropped: list[str] = []
        self.num_capped = 0
        if max_prompt_len is not None:
            rows, self.num_capped = cap_text_fields(rows, (input_key,), max_prompt_len, tokenizer)
        values = [(row, require_text_or_messages(row, input_key, "--data.input_key")) for row in rows]
        used = (input_key, image_key) + (("labels",) if label_key == "labels" else ())  # `row_columns`
        for row, value in values:
            messages = None
            images = prompt_images(row, value, processor, image_key, max_images, apply_chat_template,
                                   image_limits)
            if apply_chat_template:
                messages = to_messages(value, "user")
                if system_prompt and not (messages and messages[0].get("role") == "system"):
                    messages = [{"role": "system", "content": system_prompt}, *messages]
                text = render_chat(tokenizer, to_vision_messages(messages) if images else messages,
                                   add_generation_prompt=True, location=where(row), tools=tools)
            elif isinstance(value, str):
                text = format_prompt(input_template, value)
            else:
                raise DataError(f"{where(row)}: key '{input_key}' holds chat messages; pass "
                                "--data.apply_chat_template to render them, or point --data.input_key at "
                                "text.")
            label = get_field(row, label_key, "--data.label_key") if label_key else None
            image_inputs = None
            if images:
                encoder = ImageEncoder(tokenizer, processor, images, where(row), image_labels(row, image_key))
                ids = encoder(text)
                image_inputs = encoder.image_inputs()
            else:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                self.dropped.append(where(row))
                continue
            self.prompts.append(Prompt(text=text, token_ids=ids, label=label, source=where(row),
                                       image_inputs=image_inputs, images=images or None,
                                       image_refs=row_image_refs(row, image_key) if images else None,
                                       columns=row_columns(row, used) if extra_columns else None,
                                       messages=messages if extra_columns and not isinstance(value, str)
                                       else None))
        if not rows:
            raise DataError("no prompts: the prompt dataset has no rows (an empty file, or a split without "
                            "rows); check --data.prompt_dataset / --data.prompt_split (--eval.dataset / "
                            "--eval.split for the eval set)")
        if not self.prompts:  # every row was read and dropped as too long
            raise DataError(f"no usable prompts: all {len(rows)} rows are longer than {max_prompt_len} "
                            f"tokens (first: {self.dropped[0]}); raise --data.max_len, lower "
                            f"--rollout.max_new_tokens or shorten the prompts")

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Prompt:
        return self.prompts[i]


def row_columns(row: dict, used: tuple) -> dict:
    """The row's columns other than `used` (the input and image keys; a label column named `labels` is
    the `labels` argument itself, any other keeps its own name, as TRL passes it) and the loader's own
    (`__source__`, `__row__`): what a reward function gets as keyword arguments, as TRL passes them. The
    values are the row's own objects, not copies."""
    return {k: v for k, v in row.items() if k not in used and not (k.startswith("__") and k.endswith("__"))}


def prompt_images(row: dict, value, processor, image_key: str, max_images: int, chat: bool,
                  limits: ImageLimits = DEFAULT_IMAGE_LIMITS) -> list:
    """The row's images (PIL, each read bounded by `limits`) for a vision-language model (`processor` set),
    checked against the prompt's placeholders; [] for a text model or a row without images."""
    if processor is None:
        return []
    images = row_images(row, image_key, max_images, limits=limits)
    if images and not chat:
        raise DataError(f"{where(row)}: a prompt with images needs --data.apply_chat_template (the chat "
                        f"template places the image tokens)")
    if images or count_image_parts(value):
        check_image_count(value, images, where(row))
    return images
