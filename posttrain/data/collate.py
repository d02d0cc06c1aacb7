"""Collators turning tokenised samples (``{"input_ids", "loss_mask"}``) into model batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .vision_samples import concat_image_inputs


def _as_list(x) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def merge_image_inputs(samples: Sequence[dict | None], device=None) -> dict[str, torch.Tensor]:
    """One batch's image tensors (`image_inputs` of vision-language samples): each key concatenated along
    dim 0 over the samples that have images, in row order, the order a model matches image tokens to
    images (samples without images contribute nothing); {} when none has."""
    merged = concat_image_inputs(samples)
    return {} if merged is None else {k: torch.as_tensor(v).to(device) for k, v in merged.items()}


def pad_collate(items: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample → LongTensors ``input_ids`` (pad_id), ``attention_mask``
    (1 on real tokens) and ``loss_mask`` (0 on padding), all [B, T]; plus ``image_inputs`` when samples
    carry images (`merge_image_inputs`)."""
    if not items:
        raise ValueError("pad_collate: empty batch")
    if pad_id is None:
        raise ValueError("pad_collate: pad_id is None; set tokenizer.pad_token (e.g. to the eos token).")
    width = max(len(it["input_ids"]) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    loss = torch.zeros((len(items), width), dtype=torch.long)
    for b, it in enumerate(items):
        row_ids, row_mask = _as_list(it["input_ids"]), _as_list(it["loss_mask"])
        if len(row_ids) != len(row_mask):
            raise ValueError(
                f"pad_collate: item {b} has {len(row_ids)} input_ids but {len(row_mask)} loss_mask entries"
            )
        n = len(row_ids)
        ids[b, :n] = torch.tensor(row_ids, dtype=torch.long)
        attn[b, :n] = 1
        loss[b, :n] = torch.tensor(row_mask, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss}
    images = merge_image_inputs([it.get("image_inputs") for it in items])
    return {**batch, "image_inputs": images} if images else batch


def pack_collate(items: Sequence[dict]) -> dict:
    """Concatenate samples into one row → ``input_ids``, ``position_ids``, ``loss_mask`` [1, ΣT]
    with position ids ``0..T_k-1`` per sample, plus ``seq_lens`` (list of T_k). Each sample's first
    loss_mask entry must be 0 (the alignment contract), so no label crosses a sample boundary."""
    if not items:
        raise ValueError("pack_collate: empty batch")
    if any(it.get("image_inputs") for it in items):
        raise ValueError("pack_collate: samples with images cannot be packed (a vision-language model "
                         "computes its rotary positions per row); drop --ds.packing_samples")
    ids: list[int] = []
    mask: list[int] = []
    pos: list[int] = []
    seq_lens: list[int] = []
    for b, it in enumerate(items):
        row_ids, row_mask = _as_list(it["input_ids"]), _as_list(it["loss_mask"])
        if len(row_ids) != len(row_mask) or not row_ids:
            raise ValueError(
                f"pack_collate: item {b} has {len(row_ids)} input_ids and {len(row_mask)} loss_mask entries"
            )
        if row_mask[0] != 0:
            raise ValueError(
                f"pack_collate: item {b} has loss_mask[0] = 1; the first token of a sample is never a target"
            )
        ids += row_ids
        mask += row_mask
        pos += range(len(row_ids))
        seq_lens.append(len(row_ids))
    as_row = lambda v: torch.tensor(v, dtype=torch.long).unsqueeze(0)
    return {
        "input_ids": as_row(ids),
        "position_ids": as_row(pos),
        "loss_mask": as_row(mask),
        "seq_lens": seq_lens,
    }
