"""SFT tokenisation: rows → ``{"input_ids", "loss_mask"}`` under the token-alignment contract.

``loss_mask[i] == 1`` ⇔ token i is a training target (predicted from tokens < i); the first
token's mask is always 0. A sample is built from text *segments*, each tokenised on its own and
concatenated, so a trained span never shares a token with an untrained one and the prompt tokens
are exactly those a generator would see:

* plain (``input_template``):  [prompt (with the tokenizer's special tokens) | 0], [response | 1]
* chat template:               [render(prompt, generation prompt) | 0], [rest of render(all) | 1]
* multiturn:                   cut render(all) at render(msgs[:j], generation prompt) and
                               render(msgs[:j+1]) for every assistant message j; the pieces between
                               the two cuts are trained (the assistant text and its end-of-turn
                               marker), the rest is not. Each prefix rendering must be a textual
                               prefix of the full rendering (else DataError).
* ``pretrain_mode``:           one segment, every token but the first trained.

A chat row's ``tools`` (OpenAI function schemas, as TRL's SFT data has them) go to the chat template with
its messages, so tool calls and tool messages train as a tool episode renders them.

When the sequence ends with a trained segment, EOS is appended (and trained) unless the tokens
already end with EOS, ignoring trailing whitespace-only tokens (e.g. the newline after
``<|im_end|>``). Samples longer than ``max_len`` are cut to ``max_len`` (``num_truncated``); a
sample left with no trained token (its prompt fills ``max_len``) is dropped and counted
(``num_dropped``, ``dropped`` lists where).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

from .capping import cap_text_fields
from .errors import DataError, where
from .images import DEFAULT_IMAGE_LIMITS, ImageLimits, image_labels, to_vision_messages
from .prompts import prompt_images
from .templates import check_input_template, format_prompt, render_chat, require_chat_template, to_messages
from .validation import ensure_location, require_messages, require_text, require_text_or_messages
from .vision_samples import ImageEncoder, image_placeholder

Segment = tuple[str, int]  # (text, trained 0/1)

IN_FLAG, OUT_FLAG = "--data.input_key", "--data.output_key"


class SFTDataset(Dataset):
    """Tokenised SFT samples; ``ds[i] = {"input_ids": list[int], "loss_mask": list[int]}``.

    Attributes: ``num_dropped`` / ``dropped`` (locations of samples whose prompt alone fills
    ``max_len``), ``num_truncated``, ``sample_rows[i]`` (location of sample i), ``lengths``.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer: Any,
        max_len: int,
        *,
        input_key: str = "input",
        output_key: str | None = None,
        input_template: str | None = None,
        apply_chat_template: bool = False,
        multiturn: bool = False,
        pretrain_mode: bool = False,
        processor: Any = None,
        image_key: str = "images",
        max_images: int = 0,
        image_limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
    ):
        self.tokenizer = tokenizer
        self.processor, self.image_key, self.max_images = processor, image_key, max_images
        self.image_limits = image_limits
        self.max_len = max_len
        self.input_key, self.output_key = input_key, output_key
        self.input_template = check_input_template(input_template)
        self.chat, self.multiturn, self.pretrain = apply_chat_template, multiturn, pretrain_mode
        self._check_options()
        rows = ensure_location(list(rows))
        if not rows:
            raise DataError(
                "SFTDataset: no rows to tokenise (the dataset is empty after loading/--data.max_samples)."
            )
        rows, self.num_capped = cap_text_fields(rows, (input_key, output_key), max_len, tokenizer)
        fields = [self._validate(row) for row in rows]  # all rows, before any tokenisation

        self.samples: list[dict] = []
        self.sample_rows: list[str] = []
        self.dropped: list[str] = []
        self.num_truncated = 0
        for row, field in zip(rows, fields):
            images = self._images(row, field)
            if images:
                labels = image_labels(row, self.image_key)
                encoder = ImageEncoder(tokenizer, processor, images, where(row), labels)
                ids, mask = encode_segments(tokenizer, self._segments(row, to_vision_field(field)), encoder)
                sample = {"image_inputs": encoder.image_inputs()}
            else:
                ids, mask = self._encode(self._segments(row, field))
                sample = {}
            if len(ids) > max_len:
                if images and max(i for i, t in enumerate(ids) if t in self.image_token_ids) >= max_len:
                    self.dropped.append(where(row))  # cutting an image's tokens would orphan its features
                    continue
                ids, mask = ids[:max_len], mask[:max_len]
                self.num_truncated += 1
            if not any(mask):
                self.dropped.append(where(row))
                continue
            self.samples.append({"input_ids": ids, "loss_mask": mask, **sample})
            self.sample_rows.append(where(row))
        if not self.samples:
            raise DataError(
                f"SFTDataset: all {len(rows)} samples were dropped because the prompt alone fills "
                f"--data.max_len {max_len} (first: {self.dropped[0]}). Raise --data.max_len."
            )

    # ---- images ----------------------------------------------------------------------------------
    def _images(self, row: dict, field) -> list:
        """The row's images (PIL) for a vision-language model, checked against the prompt's placeholders."""
        return prompt_images(row, field_messages(field), self.processor, self.image_key, self.max_images,
                             self.chat, self.image_limits)

    @property
    def image_token_ids(self) -> set[int]:
        token = image_placeholder(self.processor)
        return set(self.tokenizer.convert_tokens_to_ids([token]))

    # ---- options and row checks -------------------------------------------------------------
    def _check_options(self) -> None:
        if not isinstance(self.max_len, int) or self.max_len < 2:
            raise DataError(f"--data.max_len: must be an integer ≥ 2, got {self.max_len!r}.")
        if self.multiturn and not self.chat:
            raise DataError("--data.multiturn requires --data.apply_chat_template.")
        if self.multiturn and self.pretrain:
            raise DataError(
                "--data.multiturn and --model.pretrain_mode_enable are exclusive; pass one of them."
            )
        if self.chat and self.input_template is not None:
            raise DataError(
                "--data.input_template and --data.apply_chat_template are exclusive: the chat template "
                "formats the prompt. Pass one of them."
            )
        if self.chat:
            require_chat_template(self.tokenizer)
        if self.tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token; set one (SFT appends EOS to each response).")
        if not self.pretrain and not self.chat and self.output_key is None:
            raise DataError(
                "--data.output_key is required for SFT without a chat template (the response field); or "
                "pass --model.pretrain_mode_enable to train on the whole input, or "
                "--data.apply_chat_template with message lists ending in an assistant turn."
            )

    def _validate(self, row: dict):
        """Checked, normalised fields of one row (shape depends on the mode)."""
        ik, ok = self.input_key, self.output_key
        if not self.chat:
            text = require_text(row, ik, IN_FLAG)
            return text, (require_text(row, ok, OUT_FLAG) if ok is not None else None)
        if self.multiturn:
            messages = list(require_messages(row, ik, IN_FLAG))
            if ok is not None:
                messages += to_messages(require_text_or_messages(row, ok, OUT_FLAG), "assistant")
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(
                    f"{where(row)}: key '{ik}' has no assistant message, so nothing would be trained "
                    f"(--data.multiturn trains on assistant turns). Fix the data."
                )
            return messages
        prompt = to_messages(require_text_or_messages(row, ik, IN_FLAG), "user")
        if ok is not None:
            return prompt, prompt + to_messages(require_text_or_messages(row, ok, OUT_FLAG), "assistant")
        if self.pretrain:
            return prompt, prompt
        if len(prompt) < 2 or prompt[-1]["role"] != "assistant":
            raise DataError(
                f"{where(row)}: without --data.output_key, key '{ik}' must be a message list ending in an "
                f"assistant message (the response) after at least one other message. Fix the data or pass "
                f"--data.output_key."
            )
        return prompt[:-1], prompt

    # ---- segments and tokens ----------------------------------------------------------------
    def _segments(self, row: dict, field) -> list[Segment]:
        loc = where(row)
        if not self.chat:
            prompt, response = format_prompt(self.input_template, field[0]), field[1]
            if self.pretrain:
                return [(prompt + (response or ""), 1)]
            return [(prompt, 0), (response, 1)]
        tools = row_tools(row)
        if self.multiturn:
            return self._multiturn_segments(field, loc, tools)
        prompt_msgs, full_msgs = field
        full = render_chat(self.tokenizer, full_msgs, False, loc, tools)
        if self.pretrain:
            return [(full, 1)]
        prompt = render_chat(self.tokenizer, prompt_msgs, True, loc, tools)
        self._check_prefix(prompt, full, len(prompt_msgs), len(full_msgs), loc)
        return [(prompt, 0), (full[len(prompt) :], 1)]

    def _multiturn_segments(self, messages: list[dict], loc: str, tools=None) -> list[Segment]:
        full = render_chat(self.tokenizer, messages, False, loc, tools)
        segments: list[Segment] = []
        pos = 0
        for j, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            start = self._generation_prefix(messages[:j], loc, tools)
            end = render_chat(self.tokenizer, messages[: j + 1], False, loc, tools)
            self._check_prefix(start, full, j, len(messages), loc)
            self._check_prefix(end, full, j + 1, len(messages), loc)
            if len(start) < pos or len(end) < len(start):
                raise DataError(f"{loc}: the chat template renders assistant message {j} out of order.")
            segments += [(full[pos : len(start)], 0), (full[len(start) : len(end)], 1)]
            pos = len(end)
        segments.append((full[pos:], 0))
        return segments

    def _generation_prefix(self, messages: list[dict], loc: str, tools=None) -> str:
        """Rendering of ``messages`` plus the assistant header; "" when a template rejects no messages."""
        if messages:
            return render_chat(self.tokenizer, messages, True, loc, tools)
        try:
            return render_chat(self.tokenizer, messages, True, loc, tools)
        except DataError:
            return ""

    @staticmethod
    def _check_prefix(prefix: str, full: str, k: int, n: int, loc: str) -> None:
        if not full.startswith(prefix):
            raise DataError(
                f"{loc}: the chat template is not prefix-stable: rendering the first {k} of {n} messages "
                f"is not a prefix of rendering all of them (the template rewrites earlier turns). Pass a "
                f"--data.tokenizer_chat_template that renders turns incrementally."
            )

    def _encode(self, segments: list[Segment]) -> tuple[list[int], list[int]]:
        return encode_segments(self.tokenizer, segments)

    # ---- Dataset API ------------------------------------------------------------------------
    @property
    def num_dropped(self) -> int:
        return len(self.dropped)

    @property
    def lengths(self) -> list[int]:
        return [len(s["input_ids"]) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return dict(self.samples[i])


def row_tools(row: dict) -> list[dict] | None:
    """A chat row's `tools` (OpenAI-format function schemas, as TRL's SFT data has them), rendered into its
    conversation by the chat template; None when the row has none. A `tools` value of another shape is a
    DataError."""
    tools = row.get("tools")
    if tools is None:
        return None
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where(row)}: key 'tools' must be a list of function schemas (OpenAI format), got "
                        f"{type(tools).__name__}")
    return tools or None


def field_messages(field) -> list[dict] | str:
    """The messages of a validated chat field (all of them: a multiturn list, or the full conversation)."""
    if isinstance(field, tuple):
        return field[-1] if isinstance(field[-1], list) else field[0]
    return field


def to_vision_field(field):
    """A validated chat field with its messages' contents as typed parts (`<image>` tags
    become image parts)."""
    if isinstance(field, tuple):
        return tuple(to_vision_messages(f) if isinstance(f, list) else f for f in field)
    return to_vision_messages(field)


def encode_segments(tokenizer: Any, segments: list[Segment], encode=None) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of ``segments`` (each tokenised on its own), with the EOS rule of
    the module doc; the first token's mask is 0. Never the tokenizer's own special tokens (no
    automatic BOS): the text (a chat template, or the input template) carries what it needs, and
    SFT, RM, DPO and PPO prompts all tokenise the same text to the same ids (OpenRLHF's
    ``add_special_tokens=False``). `encode(text)` replaces the tokenizer's encoding of a segment (an
    `ImageEncoder`: segments with image placeholders through the model's processor)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in segments:
        if encode is not None:
            piece = encode(text) if text else []
        else:
            piece = tokenizer.encode(text, add_special_tokens=False) if text else []
        ids += piece
        mask += [trained] * len(piece)
    if segments[-1][1] and not _ends_with_eos(tokenizer, ids):
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
    if mask:
        mask[0] = 0
    return ids, mask


def _ends_with_eos(tokenizer: Any, ids: list[int]) -> bool:
    for t in reversed(ids):
        if t == tokenizer.eos_token_id:
            return True
        if tokenizer.decode([t]).strip():
            return False
    return False
