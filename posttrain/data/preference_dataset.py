"""Preference pairs (reward models, DPO): rows → ``{"chosen_ids", "chosen_mask", "rejected_ids",
"rejected_mask", "margin"}`` under the token-alignment contract of ``sft_dataset``.

Each side is the prompt (mask 0) followed by its response and EOS (mask 1), tokenised as SFT
does, so the prompt tokens of chosen and rejected are identical and DPO's log-ratios cover the
responses only:

* ``prompt_key`` set: prompt = ``row[prompt_key]`` (text, formatted by ``input_template``, or
  messages with the chat template); each response is text (or assistant messages).
* no ``prompt_key``, chat template: each side is a whole conversation ending in an assistant
  message; the prompt is everything before it and must be the same on both sides.
* no ``prompt_key``, plain text: each side is one text, every token but the first trained
  (the reward model reads it whole; OpenRLHF's behaviour).

Each side ends exactly at its EOS (whitespace a chat template renders after it is dropped), the
token a generated response ends with and where a reward model reads its score. A side longer than
``max_len`` is cut and ends with EOS (``num_truncated``); a pair whose prompt
fills ``max_len`` is dropped and counted. Bad rows (missing key, empty response, chosen identical
to rejected, non-numeric margin) raise DataError naming the row before anything is tokenised.

Images (a vision-language model: ``processor`` set): the row's ``image_key`` column holds the images of
the prompt, placed by its ``<image>`` tags or ``{"type": "image"}`` parts (at most ``max_images``; the
chat template is needed). The prompt segment is encoded once per pair by the processor (its image
placeholders expanded into image tokens), so chosen and rejected start with the same token ids, and the
pair keeps the processor's tensors once, as ``image_inputs``, for both sides (``pair_sides``). Image tokens
lie in the prompt, before its last (untrained) tokens, so a cut at ``max_len`` that reaches them leaves no
trained token and the pair is dropped as above: no kept sequence holds part of an image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

from .capping import cap_text_fields
from .errors import DataError, where
from .images import DEFAULT_IMAGE_LIMITS, ImageLimits, image_labels, to_vision_messages
from .prompts import prompt_images
from .sft_dataset import SFTDataset, encode_segments
from .templates import check_input_template, format_prompt, render_chat, require_chat_template, to_messages
from .validation import ensure_location, require_text, require_text_or_messages
from .vision_samples import ImageEncoder

PROMPT_FLAG, CHOSEN_FLAG, REJECTED_FLAG = "--data.prompt_key", "--data.chosen_key", "--data.rejected_key"


class PreferenceDataset(Dataset):
    """Tokenised preference pairs; attributes ``num_truncated``, ``dropped``, ``pair_rows``. A pair with
    images also has ``image_inputs`` (the processor's numpy tensors, shared by its two sides)."""

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        max_len: int,
        *,
        prompt_key: str | None = None,
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        input_template: str | None = None,
        apply_chat_template: bool = False,
        margin_key: str | None = None,
        processor: Any = None,
        image_key: str = "images",
        max_images: int = 0,
        image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
    ):
        self.keys = (prompt_key, chosen_key, rejected_key)
        self.margin_key = margin_key
        self.processor, self.image_key, self.max_images = processor, image_key, max_images
        self.image_limits = image_limits
        rows = self._start(rows, tokenizer, max_len, input_template, apply_chat_template, self.keys)
        fields = [self._validate(row) for row in rows]  # every row, before any tokenisation

        self.pairs: list[dict] = []
        self.pair_rows: list[str] = []
        self.dropped: list[str] = []
        self.num_truncated = 0
        for row, (prompt, chosen, rejected, margin) in zip(rows, fields):
            images = self._images(row, prompt)
            encoder = _SharedPrompt(ImageEncoder(tokenizer, processor, images, where(row),
                                                 image_labels(row, self.image_key))) if images else None
            sides = [self._encode(row, prompt, response, encoder) for response in (chosen, rejected)]
            if any(ids is None for ids, _ in sides):
                self.dropped.append(where(row))
                continue
            (c_ids, c_mask), (r_ids, r_mask) = sides
            pair = {"chosen_ids": c_ids, "chosen_mask": c_mask, "rejected_ids": r_ids,
                    "rejected_mask": r_mask, "margin": margin}
            if encoder is not None:
                pair["image_inputs"] = encoder.image_inputs()
            self.pairs.append(pair)
            self.pair_rows.append(where(row))
        if not self.pairs:
            raise DataError(f"PreferenceDataset: all {len(rows)} pairs were dropped because the prompt alone "
                            f"fills --data.max_len {max_len} (first: {self.dropped[0]}). Raise "
                            f"--data.max_len.")

    def _start(self, rows: Sequence[dict], tokenizer: Any, max_len: int, input_template: str | None,
               apply_chat_template: bool, text_keys) -> list[dict]:
        """The checks and set-up before any row is read (max_len, EOS, template vs chat template; the rows
        located, their `text_keys` fields capped: `num_capped`); returns the rows."""
        if not isinstance(max_len, int) or max_len < 2:
            raise DataError(f"--data.max_len: must be an integer ≥ 2, got {max_len!r}.")
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token; set one (each response ends with EOS).")
        self.tokenizer, self.max_len, self.chat = tokenizer, max_len, apply_chat_template
        self.input_template = check_input_template(input_template)
        if self.chat:
            require_chat_template(tokenizer)
            if self.input_template is not None:
                raise DataError("--data.input_template and --data.apply_chat_template are exclusive: the "
                                "chat template formats the prompt. Pass one of them.")
        rows = ensure_location(list(rows))
        if not rows:
            raise DataError(f"{type(self).__name__}: no rows (the dataset is empty after "
                            "loading/--data.max_samples).")
        rows, self.num_capped = cap_text_fields(rows, text_keys, max_len, tokenizer)
        return rows

    # ---- images -------------------------------------------------------------------------------
    def _images(self, row: dict, prompt) -> list:
        """The row's images (PIL) for a vision-language model, checked against the prompt's placeholders."""
        return prompt_images(row, prompt if prompt is not None else "", self.processor, self.image_key,
                             self.max_images, self.chat, self.image_limits)

    # ---- row checks ---------------------------------------------------------------------------
    def _validate(self, row: dict):
        """(prompt, chosen, rejected, margin) of one row, checked."""
        prompt_key, chosen_key, rejected_key = self.keys
        loc = where(row)
        prompt = None
        if prompt_key is not None:
            prompt = require_text_or_messages(row, prompt_key, PROMPT_FLAG) if self.chat \
                else require_text(row, prompt_key, PROMPT_FLAG)
        read = require_text_or_messages if self.chat else require_text
        chosen, rejected = read(row, chosen_key, CHOSEN_FLAG), read(row, rejected_key, REJECTED_FLAG)
        if self.chat:
            if prompt is None:
                chosen, rejected, prompt = self._split_conversations(row, chosen, rejected)
            else:
                prompt = to_messages(prompt, "user")
                chosen, rejected = to_messages(chosen, "assistant"), to_messages(rejected, "assistant")
            for key, msgs in ((chosen_key, chosen), (rejected_key, rejected)):
                last = msgs[-1] if msgs else {}
                if not (_content_text(last.get("content")).strip() or last.get("tool_calls")):
                    raise DataError(f"{loc}: key '{key}' has an empty response. Fix the data (fill it in or "
                                    "remove the row).")
        if chosen == rejected:
            raise DataError(f"{loc}: '{chosen_key}' and '{rejected_key}' are identical, so the pair prefers "
                            "nothing. Fix the data (remove the row or correct one side).")
        margin = 0.0
        if self.margin_key is not None:
            if self.margin_key not in row:
                raise DataError(f"{loc}: missing key '{self.margin_key}' (the row has keys "
                                f"{sorted(k for k in row if not k.startswith('__'))}), which "
                                "--model.margin_loss_enable reads in every row of the training and eval "
                                f"data. Add a numeric '{self.margin_key}' to each row, or drop "
                                f"--model.margin_loss_enable.")
            value = row[self.margin_key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise DataError(f"{loc}: key '{self.margin_key}' must be a number, got {value!r}. Fix the "
                                f"data, or drop --model.margin_loss_enable.")
            margin = float(value)
        return prompt, chosen, rejected, margin

    def _split_conversations(self, row: dict, chosen, rejected):
        """Whole conversations → (chosen reply, rejected reply, shared prompt messages)."""
        _, chosen_key, rejected_key = self.keys
        loc = where(row)
        for key, side in ((chosen_key, chosen), (rejected_key, rejected)):
            if not isinstance(side, list) or side[-1]["role"] != "assistant":
                raise DataError(f"{loc}: without --data.prompt_key, key '{key}' must be a message list "
                                f"ending in an assistant message. Fix the data, or pass --data.prompt_key.")
        if chosen[:-1] != rejected[:-1]:
            raise DataError(f"{loc}: '{chosen_key}' and '{rejected_key}' have different prompts (the "
                            f"messages before the last assistant reply differ). A pair must share its "
                            f"prompt.")
        return chosen[-1:], rejected[-1:], chosen[:-1]

    # ---- tokens -------------------------------------------------------------------------------
    def _segments(self, row: dict, prompt, response, images: bool = False) -> list[tuple[str, int]]:
        loc = where(row)
        if not self.chat:
            if prompt is None:
                return [(response, 1)]
            return [(format_prompt(self.input_template, prompt), 0), (response, 1)]
        # the prompt's contents as typed parts (`<image>` tags become image parts); responses are text
        if images:
            prompt = to_vision_messages(prompt)
        full_msgs = prompt + response
        full = render_chat(self.tokenizer, full_msgs, False, loc)
        if not prompt:
            return [(full, 1)]
        head = render_chat(self.tokenizer, prompt, True, loc)
        SFTDataset._check_prefix(head, full, len(prompt), len(full_msgs), loc)
        return [(head, 0), (full[len(head):], 1)]

    def _encode(self, row: dict, prompt, response, encoder=None) -> tuple[list[int] | None, list[int] | None]:
        ids, mask = encode_segments(self.tokenizer,
                                    self._segments(row, prompt, response, encoder is not None), encoder)
        ids, mask = self._end_at_eos(ids, mask)
        if len(ids) > self.max_len:
            ids, mask = ids[: self.max_len], mask[: self.max_len]
            ids[-1] = self.tokenizer.eos_token_id
            self.num_truncated += 1
        if not any(mask):
            return None, None
        return ids, mask

    def _end_at_eos(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        """Drop whitespace-only tokens after the final EOS (a chat template's newline after
        ``<|im_end|>``): a generated response stops at EOS, and a reward model scores it there."""
        eos, end = self.tokenizer.eos_token_id, len(ids)
        while end > 1 and ids[end - 1] != eos and not self.tokenizer.decode([ids[end - 1]]).strip():
            end -= 1
        return (ids[:end], mask[:end]) if end < len(ids) and ids[end - 1] == eos else (ids, mask)

    # ---- Dataset API ----------------------------------------------------------------------------
    @property
    def num_dropped(self) -> int:
        return len(self.dropped)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        return self.pairs[i]


class _SharedPrompt:
    """`encode(text)` for both sides of one pair: an `ImageEncoder` whose results are kept per text, so the
    prompt segment (the same text on both sides) is encoded, and takes its images, once."""

    def __init__(self, encoder: ImageEncoder) -> None:
        self.encoder, self.done = encoder, {}

    def __call__(self, text: str) -> list[int]:
        if text not in self.done:
            self.done[text] = self.encoder(text)
        return list(self.done[text])

    def image_inputs(self):
        return self.encoder.image_inputs()


def pair_sides(items: Sequence[dict]) -> list[dict]:
    """Pairs → 2B SFT-shaped samples, all chosen sides first then all rejected sides (row b and
    b + B are a pair), ready for ``pad_collate`` / ``pack_collate``. A pair's ``image_inputs`` go with
    both of its sides, so the collated ``image_inputs`` are the chosen sides' images in pair order, then
    the rejected sides' in the same order: the order of the rows, in which the model matches images to
    image tokens."""
    def side(it: dict, name: str) -> dict:
        sample = {"input_ids": it[f"{name}_ids"], "loss_mask": it[f"{name}_mask"]}
        if it.get("image_inputs"):
            sample["image_inputs"] = it["image_inputs"]
        return sample

    return [side(it, "chosen") for it in items] + [side(it, "rejected") for it in items]


def _content_text(content) -> str:
    """A message content's text: the string, or its text parts joined (a content given as typed parts)."""
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")
