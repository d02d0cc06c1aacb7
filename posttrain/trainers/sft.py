"""Supervised fine-tuning: token-mean negative log-likelihood of the response tokens.

loss = Σ_{i} m_i · (−log π(x_i | x_<i)) / N, with m the loss mask (response tokens and their EOS;
every token but the first in pretrain mode; every assistant turn with --data.multiturn) and N the
number of target tokens in the whole optimizer step across micro-batches and ranks, so the
gradient does not depend on how the step is split (docs/algorithms.md, "Loss aggregation").
"""
from __future__ import annotations

import torch

from posttrain.algorithms.losses import aggregate, token_logprobs
from posttrain.config import SFTConfig, changed_values
from posttrain.data import SFTDataset, pack_collate, pad_collate
from posttrain.data.capping import capped_note
from posttrain.data.errors import check_dropped
from posttrain.data.images import image_reading
from posttrain.models import next_token_logits
from posttrain.trainers.session import SingleModelRun
from posttrain.utils.log import info


class SFTObjective:
    def __init__(self, pad_id: int, packing: bool) -> None:
        self.pad_id = pad_id
        self.packing = packing

    def units(self, item: dict) -> int:
        return int(sum(item["loss_mask"][1:]))

    def collate(self, items: list[dict]) -> dict:
        return pack_collate(items) if self.packing else pad_collate(items, self.pad_id)

    def loss(self, model, batch: dict, num_units: float):
        logits, labels, mask = next_token_logits(model, batch)  # padded, packed or a context-parallel slice
        return self.nll(logits, labels, mask, num_units)

    @staticmethod
    def nll(logits, labels, mask, num_units: float):
        """(the token-mean NLL over the step's `num_units` target tokens, its additive statistics)."""
        nll = -token_logprobs(logits, labels)
        loss = aggregate(nll, mask, "token_mean", num_tokens=num_units)
        with torch.no_grad():
            correct = (logits.argmax(-1) == labels).float()
            stats = {"loss_sum": float((nll * mask).sum()), "loss_count": float(mask.sum()),
                     "acc_sum": float((correct * mask).sum()), "acc_count": float(mask.sum())}
        return loss, stats


def prompt_template(cfg: SFTConfig) -> str | None:
    """The plain-text template, unless the chat template formats prompts. SFT's default
    template ("User: {}\\nAssistant: ") yields to --data.apply_chat_template as in OpenRLHF; a
    template the user set explicitly together with it is an error raised by the dataset."""
    if cfg.data.apply_chat_template and "data.input_template" not in changed_values(cfg):
        return None
    return cfg.data.input_template


def sft_items(run: SingleModelRun, cfg: SFTConfig) -> tuple[list[dict], list[dict] | None]:
    """The tokenised training and eval samples of SFT's rows (eval: None without an eval set), the dropped
    and capped samples reported."""
    tok = run.tokenizer
    data_kwargs = dict(input_key=cfg.data.input_key, output_key=cfg.data.output_key,
                       input_template=prompt_template(cfg),
                       apply_chat_template=cfg.data.apply_chat_template,
                       multiturn=cfg.data.multiturn, pretrain_mode=cfg.model.pretrain_mode_enable,
                       processor=run.processor, **image_reading(cfg.data))
    train_set = SFTDataset(run.train_rows, tok, cfg.data.max_len, **data_kwargs)
    eval_set = SFTDataset(run.eval_rows, tok, cfg.data.max_len, **data_kwargs) if run.eval_rows else None
    for what, data in (("train", train_set), ("eval", eval_set)):
        if data is not None:
            report = check_dropped(f"SFT {what} set", data.dropped, len(data) + data.num_dropped,
                                   f"the prompt alone fills --data.max_len {cfg.data.max_len}",
                                   cfg.data.max_dropped_frac)
            if report:
                info(report)
            if data.num_capped:
                info(capped_note(f"SFT {what} set", data.num_capped, cfg.data.max_len, tok))
    return ([train_set[i] for i in range(len(train_set))],
            [eval_set[i] for i in range(len(eval_set))] if eval_set else None)


def train_sft(cfg: SFTConfig) -> dict:
    """Run SFT as configured; returns the final eval metrics (empty without an eval set)."""
    with SingleModelRun(cfg) as run:  # a failure before training leaves no run files
        train_items, eval_items = sft_items(run, cfg)
        objective = SFTObjective(run.tokenizer.pad_token_id, packing=cfg.ds.packing_samples)
        return run.fit(objective, train_items, eval_items)
