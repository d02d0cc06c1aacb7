"""Unpaired preference rows (KTO): a prompt, one completion and a label, true (desirable) or false
(undesirable) → ``{"prompt_ids", "completion_ids", "label"}``, tokenised as `PreferenceDataset` tokenises
one side of a pair (the prompt, then the completion ending at EOS; a completion longer than ``max_len`` is
cut and ends with EOS, a row whose prompt fills ``max_len`` is dropped and counted).

Keys: the prompt is ``row[input_key]``, by default ``input`` (OpenRLHF) or else ``prompt`` (TRL); the
completion ``row[output_key]``, by default ``completion`` (TRL); without one, and with the chat template,
the prompt key holds the whole conversation ending in the assistant reply, which is the completion
(OpenRLHF). The label ``row[label_key]`` must be a JSON boolean (or OpenRLHF 0.9's 1 / 0). Bad rows raise
DataError naming the row and the key before anything is tokenised. Text only (no images).

`kl_sides` builds the mismatched sequences of KTO's KL estimate: each row's prompt with another row's
completion (cut to ``max_len`` like a row, ending with EOS).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import DataError, where
from .preference_dataset import PreferenceDataset
from .templates import to_messages
from .validation import get_field, require_text, require_text_or_messages

INPUT_FLAG, OUTPUT_FLAG, LABEL_FLAG = "--data.input_key", "--data.output_key", "--data.label_key"
DEFAULT_INPUT_KEYS, DEFAULT_OUTPUT_KEYS = ("input", "prompt"), ("completion",)


class UnpairedDataset(PreferenceDataset):
    """Tokenised unpaired rows; attributes ``num_truncated``, ``dropped``, ``num_capped``, ``pair_rows``
    (each kept item's row location), as `PreferenceDataset`."""

    def __init__(self, rows: Sequence[dict], tokenizer: Any, max_len: int, *, input_key: str | None = None,
                 output_key: str | None = None, label_key: str = "label", input_template: str | None = None,
                 apply_chat_template: bool = False):
        self.processor, self.unpaired_keys = None, (input_key, output_key, label_key)
        text_keys = ((input_key,) if input_key else DEFAULT_INPUT_KEYS) + \
            ((output_key,) if output_key else DEFAULT_OUTPUT_KEYS)
        rows = self._start(rows, tokenizer, max_len, input_template, apply_chat_template, text_keys)
        fields = [self._read(row) for row in rows]  # every row, before any tokenisation
        self.pairs, self.pair_rows, self.dropped, self.num_truncated = [], [], [], 0
        for row, (prompt, completion, label) in zip(rows, fields):
            ids, mask = self._encode(row, prompt, completion)
            if ids is None:
                self.dropped.append(where(row))
                continue
            cut = mask.index(1)
            self.pairs.append({"prompt_ids": ids[:cut], "completion_ids": ids[cut:], "label": label})
            self.pair_rows.append(where(row))
        if not self.pairs:
            raise DataError(f"UnpairedDataset: all {len(rows)} rows were dropped because the prompt alone "
                            f"fills --data.max_len {max_len} (first: {self.dropped[0]}). Raise "
                            f"--data.max_len.")

    def _read(self, row: dict):
        """(prompt, completion, label) of one row, checked."""
        input_key, output_key, label_key = self.unpaired_keys
        loc = where(row)
        p_key = _resolve(row, input_key, DEFAULT_INPUT_KEYS)
        c_key = _resolve(row, output_key, DEFAULT_OUTPUT_KEYS)
        if p_key is None:
            raise DataError(f"{loc}: no prompt: the row has neither 'input' (OpenRLHF) nor 'prompt' (TRL) "
                            f"(its keys: {sorted(k for k in row if not k.startswith('__'))}); name the "
                            f"prompt's key with {INPUT_FLAG}.")
        if c_key is None and not self.chat:
            raise DataError(f"{loc}: no completion: the row has no 'completion' (TRL); name the completion's "
                            f"key with {OUTPUT_FLAG} (or, with --data.apply_chat_template, put the "
                            f"conversation ending in the reply under the prompt key).")
        read = require_text_or_messages if self.chat else require_text
        prompt = read(row, p_key, INPUT_FLAG)
        completion = read(row, c_key, OUTPUT_FLAG) if c_key is not None else None
        label = get_field(row, label_key, LABEL_FLAG)
        if not (isinstance(label, bool) or (type(label) is int and label in (0, 1))):
            raise DataError(f"{loc}: key '{label_key}' must be true or false (or OpenRLHF's 1 or 0: the "
                            f"completion is desirable or not), got {label!r}. Fix the data, or pass "
                            f"{LABEL_FLAG} to pick another field.")
        label = bool(label)
        if self.chat:
            if completion is None:
                if not isinstance(prompt, list) or prompt[-1]["role"] != "assistant":
                    raise DataError(f"{loc}: without a completion key, key '{p_key}' must be a message list "
                                    f"ending in an assistant message. Fix the data, or pass {OUTPUT_FLAG}.")
                prompt, completion = prompt[:-1], prompt[-1:]
            else:
                prompt, completion = to_messages(prompt, "user"), to_messages(completion, "assistant")
            if not prompt:
                raise DataError(f"{loc}: key '{p_key}' has no prompt before the reply; KTO needs one.")
        return prompt, completion, label


def _resolve(row: dict, key: str | None, defaults: tuple[str, ...]) -> str | None:
    """`key` when set (the row must have it: checked when read), else the first of `defaults` the row has."""
    if key is not None:
        return key
    return next((k for k in defaults if k in row), None)


def row_sides(items: Sequence[dict]) -> list[dict]:
    """Items → SFT-shaped samples ``{"input_ids", "loss_mask"}`` (the prompt masked), for the collators."""
    return [{"input_ids": it["prompt_ids"] + it["completion_ids"],
             "loss_mask": [0] * len(it["prompt_ids"]) + [1] * len(it["completion_ids"])} for it in items]


def kl_sides(items: Sequence[dict], partners: Sequence[dict], max_len: int, eos_id: int) -> list[dict]:
    """Item k's prompt with ``partners[k]``'s completion, as `row_sides`, cut to `max_len` with EOS last
    (a prompt is shorter than `max_len`, so a cut sequence keeps at least one completion token)."""
    out = []
    for it, partner in zip(items, partners, strict=True):
        side = row_sides([{"prompt_ids": it["prompt_ids"], "completion_ids": partner["completion_ids"]}])[0]
        if len(side["input_ids"]) > max_len:
            side = {"input_ids": side["input_ids"][:max_len - 1] + [eos_id],
                    "loss_mask": side["loss_mask"][:max_len]}
        out.append(side)
    return out
