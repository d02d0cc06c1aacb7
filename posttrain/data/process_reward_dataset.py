"""Step-labelled rows (process reward models, `posttrain prm`) → items
``{"input_ids", "loss_mask", "step_labels"}``.

Two layouts, told apart by each row's keys:

- OpenRLHF / Math-Shepherd: ``row[input_key]`` (default ``input``) a text with the placeholder token after
  each step, ``row[label_key]`` (default ``label``) one label per placeholder: label tokens (strings; one of
  the reward tokens when they are given) or probabilities in [0, 1] that the step is good (soft labels; two
  reward tokens, the good one first);
- TRL stepwise supervision: ``prompt`` (text, may be empty), ``completions`` (the step strings) and
  ``labels`` (true / false per step), rendered by
  ``render_steps(prompt, completions, placeholder, separator)`` (`algorithms.process_reward`); true is the
  first (good) reward token, false the second.

A step label is a reward-token index (hard; without reward tokens, the label token's id in the vocabulary)
or a float (soft); one dataset holds one kind. The text is tokenised as it is (no special tokens, no
template, as OpenRLHF's train_prm); every placeholder must stay one token after tokenising the whole text.
A text longer than ``max_len`` is cut: the labels of the placeholders cut off are dropped (as OpenRLHF) and
counted (``labels_cut``, ``rows_cut``); a row left without a placeholder is dropped (``dropped``). Bad rows
raise DataError naming the file, the row and the key, every row checked before any is tokenised.
``loss_mask`` is all zeros: the loss reads the placeholders, not next tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from posttrain.algorithms.process_reward import render_steps

from .errors import DataError, where
from .validation import _short, ensure_location, get_field, require_text

INPUT_FLAG, LABEL_FLAG = "--data.input_key", "--data.label_key"
TRL_KEYS = ("prompt", "completions", "labels")


class ProcessRewardDataset:
    """Tokenised step-labelled rows: ``items`` (list), ``soft`` (the labels are probabilities), ``dropped``
    (locations of rows left without a step), ``rows_cut`` and ``labels_cut`` (rows cut at ``max_len``, labels
    dropped with their placeholders)."""

    def __init__(self, rows: Sequence[dict], tokenizer: Any, max_len: int, *, placeholder: str,
                 placeholder_id: int, reward_tokens: list[str] | None, token_id: Callable[[str], int],
                 input_key: str | None = None, label_key: str | None = None, separator: str = "\n"):
        """`placeholder_id`: the placeholder's token id; `token_id(label)`: a label token's id (read only
        without `reward_tokens`, whose labels index the vocabulary)."""
        self.placeholder, self.reward_tokens, self.token_id = placeholder, reward_tokens, token_id
        self.keys, self.separator = (input_key, label_key), separator
        rows = ensure_location(list(rows))
        read = [self._read(row) for row in rows]  # every row checked before any is tokenised
        self.soft = bool(read) and isinstance(read[0][1][0], float)
        for row, (_, labels) in zip(rows, read):
            if isinstance(labels[0], float) != self.soft:
                raise DataError(f"{where(row)}: its step labels are {_kind(not self.soft)} but those of "
                                f"{where(rows[0])} are {_kind(self.soft)}; a dataset holds one kind. Fix the "
                                "data.")
        self.items, self.dropped, self.rows_cut, self.labels_cut = [], [], 0, 0
        for row, (text, labels) in zip(rows, read):
            ids = tokenizer.encode(text, add_special_tokens=False)
            found = ids.count(placeholder_id)
            if found != len(labels):
                raise DataError(f"{where(row)}: the placeholder {placeholder!r} occurs {len(labels)} times "
                                f"in the text but is token {placeholder_id} only {found} times after "
                                "tokenising it (merged with its neighbours); choose a placeholder the "
                                "tokenizer keeps apart, or a space or a line break around it in the data.")
            if len(ids) > max_len:
                ids = ids[:max_len]
                kept = ids.count(placeholder_id)
                self.rows_cut += 1
                self.labels_cut += len(labels) - kept
                labels = labels[:kept]
            if not labels:
                self.dropped.append(where(row))
                continue
            self.items.append({"input_ids": ids, "loss_mask": [0] * len(ids), "step_labels": labels})
        if rows and not self.items:
            raise DataError(f"ProcessRewardDataset: all {len(rows)} rows were dropped because --data.max_len "
                            f"{max_len} cuts off their first step's placeholder (first: {self.dropped[0]}). "
                            "Raise --data.max_len.")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    # ---- reading one row ------------------------------------------------------------------------------
    def _read(self, row: dict) -> tuple[str, list]:
        """(the text with its placeholders, one label per placeholder: int indices or floats), checked."""
        input_key, label_key = self.keys
        if input_key is None and "input" not in row and "completions" in row:
            text, labels = self._trl_row(row)
            key, flag = "labels", LABEL_FLAG
        else:
            key, flag = label_key or "label", LABEL_FLAG
            text = require_text(row, input_key or "input", INPUT_FLAG)
            labels = [self._label(row, key, v) for v in _label_list(row, key, flag)]
        count = text.count(self.placeholder)
        if count != len(labels):
            raise DataError(f"{where(row)}: {count} placeholders {self.placeholder!r} in the text but "
                            f"{len(labels)} labels under '{key}'; each step ends with one placeholder and "
                            "has one label. Fix the data.")
        if len({isinstance(v, float) for v in labels}) > 1:
            raise DataError(f"{where(row)}: key '{key}' mixes label tokens and probabilities; use one kind. "
                            "Fix the data.")
        return text, labels

    def _trl_row(self, row: dict) -> tuple[str, list[int]]:
        """TRL's stepwise supervision: the rendered text and each step's reward-token index."""
        prompt = get_field(row, "prompt", INPUT_FLAG)
        steps = _label_list(row, "completions", INPUT_FLAG)
        flags = _label_list(row, "labels", LABEL_FLAG)
        if not isinstance(prompt, str) or not all(isinstance(s, str) and s.strip() for s in steps):
            raise DataError(f"{where(row)}: TRL's stepwise layout needs 'prompt' text and 'completions' a "
                            "list of non-empty step strings. Fix the data.")
        if len(flags) != len(steps) or not all(isinstance(f, bool) for f in flags):
            raise DataError(f"{where(row)}: key 'labels' must hold one true / false per step of "
                            f"'completions' ({len(steps)}), got {_short(flags)}. Fix the data.")
        if not self.reward_tokens:
            raise DataError(f"{where(row)}: TRL's stepwise layout labels steps true / false, which need two "
                            "reward tokens: pass --model.reward_tokens GOOD BAD (e.g. + -).")
        return render_steps(prompt, steps, self.placeholder, self.separator), [0 if f else 1 for f in flags]

    def _label(self, row: dict, key: str, value) -> int | float:
        """A label token's reward-token index (its vocabulary id without reward tokens), or a probability."""
        tokens = self.reward_tokens
        if isinstance(value, str):
            if tokens is None:
                return self.token_id(value)
            if value not in tokens:
                raise DataError(f"{where(row)}: label {value!r} under '{key}' is not one of "
                                f"--model.reward_tokens {' '.join(tokens)}. Fix the data, or name its tokens "
                                "with --model.reward_tokens.")
            return tokens.index(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
            if tokens is None or len(tokens) != 2:
                raise DataError(f"{where(row)}: key '{key}' holds probabilities (soft labels), which need "
                                "exactly two reward tokens, the good one first: pass --model.reward_tokens "
                                "GOOD BAD (e.g. + -).")
            return float(value)
        raise DataError(f"{where(row)}: key '{key}' must hold label tokens (strings) or probabilities in "
                        f"[0, 1], got {_short(value)}. Fix the data, or pass {LABEL_FLAG} to pick another "
                        "field.")


def _label_list(row: dict, key: str, flag: str) -> list:
    value = get_field(row, key, flag)
    if not isinstance(value, list) or not value:
        raise DataError(f"{where(row)}: key '{key}' must be a non-empty list (one entry per step), got "
                        f"{_short(value)}. Fix the data.")
    return value


def _kind(soft: bool) -> str:
    return "probabilities" if soft else "label tokens"
