"""Preference pairs for the RM and DPO trainers: rows → tokenised pair items, with what was cut or
dropped reported once (see `posttrain.data.preference_dataset` for the layout and checks)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from posttrain.data import pack_collate, pad_collate
from posttrain.data.capping import capped_note
from posttrain.data.errors import check_dropped
from posttrain.data.images import image_reading
from posttrain.data.preference_dataset import PreferenceDataset, pair_sides
from posttrain.utils.log import info

if TYPE_CHECKING:
    from posttrain.config import DPOConfig, RMConfig


class PairObjective:
    """What the RM and DPO objectives share: units are pairs, and a micro-batch of B pairs is one
    forward of 2B sequences (rows 0..B-1 chosen, B..2B-1 rejected; padded or packed) carrying
    ``num_pairs`` = B and each pair's ``margin`` [B]; with images, ``image_inputs`` in the same row order
    (pair b's images for row b and again for row B + b, see `pair_sides`)."""

    def __init__(self, pad_id: int, packing: bool) -> None:
        self.pad_id, self.packing = pad_id, packing

    def units(self, item: dict) -> int:
        return 1

    def length(self, item: dict) -> int:
        """Tokens the pair puts in a micro-batch (both sides), for --train.dynamic_batch_enable."""
        return len(item["chosen_ids"]) + len(item["rejected_ids"])

    def collate(self, items: list[dict]) -> dict:
        sides = pair_sides(items)
        batch = pack_collate(sides) if self.packing else pad_collate(sides, self.pad_id)
        batch["num_pairs"] = len(items)
        batch["margin"] = torch.tensor([float(it["margin"]) for it in items])
        return batch


def preference_items(rows: list[dict], tokenizer, cfg: RMConfig | DPOConfig, what: str,
                     margin_key: str | None = None, processor=None) -> list[dict]:
    """Items `{"chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask", "margin"}` (plus
    `"image_inputs"` for a pair with images) of `rows` under `cfg.data` (prompt/chosen/rejected keys,
    template, chat template, max_len; the image column and its bound when `processor`, a vision-language
    model's, is given)."""
    data = PreferenceDataset(rows, tokenizer, cfg.data.max_len, prompt_key=cfg.data.prompt_key,
                             chosen_key=cfg.data.chosen_key, rejected_key=cfg.data.rejected_key,
                             input_template=cfg.data.input_template,
                             apply_chat_template=cfg.data.apply_chat_template, margin_key=margin_key,
                             processor=processor, **image_reading(cfg.data))
    return tokenised_items(data, what, cfg, tokenizer)


def tokenised_items(data: PreferenceDataset, what: str, cfg, tokenizer) -> list[dict]:
    """The items of a tokenised preference dataset (pairs, or KTO's unpaired rows), after reporting once
    what was cut, dropped (stopping the run past --data.max_dropped_frac) or capped."""
    if data.num_truncated:
        info(f"{what}: {data.num_truncated} responses longer than --data.max_len {cfg.data.max_len} were cut "
             "(their last token kept as EOS)")
    report = check_dropped(what, data.dropped, len(data) + data.num_dropped,
                           f"the prompt alone fills --data.max_len {cfg.data.max_len}",
                           cfg.data.max_dropped_frac)
    if report:
        info(report)
    if data.num_capped:
        info(capped_note(what, data.num_capped, cfg.data.max_len, tokenizer))
    return [data[i] for i in range(len(data))]
