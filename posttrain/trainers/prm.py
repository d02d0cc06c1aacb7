"""Process reward model (PRM) training on step-labelled rows (OpenRLHF 0.9's train_prm).

The model is the causal LM itself: at each step's placeholder token (``--model.placeholder_token``) its
next-token logits over the reward tokens (``--model.reward_tokens``, the good one first; none: the whole
vocabulary) are the step's prediction ``z`` (`algorithms.process_reward.placeholder_logits`). With ``ℓ`` the
step's cross entropy against its label (a reward-token index, or the probability ``p`` of the good token:
``−(p log s_0 + (1 − p) log s_1)``, ``s = softmax(z)``),

    loss = Σ_steps ℓ / N

with ``N`` the labelled steps of the whole optimizer step (all micro-batches, all ranks: `prm_loss`'s
``num_steps``), so how a step is split does not change it (OpenRLHF: the mean over each micro-batch).
Logged per step: ``loss`` and ``acc`` (the argmax reward token is the label; `prm_correct`).

The rows (`data.process_reward_dataset`): OpenRLHF's text with a placeholder after each step and its labels,
or TRL's stepwise supervision. Every export (``--ckpt.save_hf`` and the final model) writes ``prm.json``
(`models.prm_spec`) beside config.json when the reward tokens are known, which `posttrain ppo
--reward.prm` reads.
"""
from __future__ import annotations

import torch

from posttrain.algorithms.process_reward import placeholder_logits, prm_correct, prm_loss
from posttrain.config import PRMConfig
from posttrain.data import pack_collate, pad_collate
from posttrain.data.errors import DataError, check_dropped
from posttrain.data.process_reward_dataset import ProcessRewardDataset
from posttrain.models import forward_logits
from posttrain.models.prm_spec import PRMSpec, one_token_id, save_prm_spec
from posttrain.trainers.session import ExportHooks, SingleModelRun
from posttrain.utils.errors import ConfigError
from posttrain.utils.log import info


class PRMObjective:
    """The `Objective` of the step loop for a PRM: units are labelled steps; a micro-batch of rows (padded or
    packed) carries ``step_labels`` [S], its rows' labels in row-major placeholder order."""

    def __init__(self, pad_id: int, packing: bool, placeholder_id: int, reward_token_ids: list[int] | None,
                 soft: bool) -> None:
        self.pad_id, self.packing, self.soft = pad_id, packing, soft
        self.placeholder_id, self.reward_token_ids = placeholder_id, reward_token_ids

    def units(self, item: dict) -> int:
        return len(item["step_labels"])

    def collate(self, items: list[dict]) -> dict:
        batch = pack_collate(items) if self.packing else pad_collate(items, self.pad_id)
        dtype = torch.float32 if self.soft else torch.long
        batch["step_labels"] = torch.tensor([v for it in items for v in it["step_labels"]], dtype=dtype)
        return batch

    def loss(self, model, batch: dict, num_units: float):
        ids = batch["input_ids"]
        keep = (ids == self.placeholder_id).any(0).nonzero().squeeze(1)  # only the placeholders' columns
        logits = forward_logits(model, batch, keep=keep)
        step_logits = placeholder_logits(logits, ids[:, keep.to(ids.device)], self.placeholder_id,
                                         self.reward_token_ids)
        labels = batch["step_labels"].to(step_logits.device)
        loss = prm_loss(step_logits, labels, num_steps=num_units)
        with torch.no_grad():
            n = float(labels.shape[0])
            stats = {"loss_sum": float(loss) * num_units, "loss_count": n,
                     "acc_sum": float(prm_correct(step_logits, labels).sum()), "acc_count": n}
        return loss, stats


def prm_items(rows: list[dict], tokenizer, cfg: PRMConfig, placeholder_id: int,
              what: str) -> ProcessRewardDataset:
    """The tokenised rows under `cfg` (`ProcessRewardDataset`), with the cut labels and dropped rows reported
    (a share of dropped rows over --data.max_dropped_frac stops the run)."""
    d, m = cfg.data, cfg.model
    data = ProcessRewardDataset(rows, tokenizer, d.max_len, placeholder=m.placeholder_token,
                                placeholder_id=placeholder_id, reward_tokens=m.reward_tokens,
                                token_id=lambda t: one_token_id(tokenizer, t, "label token"),
                                input_key=d.input_key, label_key=d.label_key, separator=d.step_separator)
    if data.rows_cut:
        info(f"{what}: {data.rows_cut} rows longer than --data.max_len {d.max_len} were cut; "
             f"{data.labels_cut} step labels whose placeholders were cut off are dropped")
    report = check_dropped(what, data.dropped, len(data) + len(data.dropped),
                           f"--data.max_len {d.max_len} cuts off their first step", d.max_dropped_frac)
    if report:
        info(report)
    return data


def train_prm(cfg: PRMConfig) -> dict:
    """Run PRM training as configured (the flags validated: `config.validate`); returns the final eval
    metrics (empty without an eval set)."""
    with SingleModelRun(cfg) as run:  # a failure before training leaves no run files
        tok, m = run.tokenizer, cfg.model
        placeholder_id = one_token_id(tok, m.placeholder_token, "placeholder token")
        spec = PRMSpec(m.placeholder_token, m.reward_tokens, cfg.data.step_separator) \
            if m.reward_tokens else None
        reward_ids = spec.token_ids(tok)[1] if spec is not None else None
        if placeholder_id == tok.pad_token_id:
            raise ConfigError(f"--model.placeholder_token {m.placeholder_token!r} is the tokenizer's padding "
                              "token; choose another token")
        train = prm_items(run.train_rows, tok, cfg, placeholder_id, "train set")
        held = prm_items(run.eval_rows, tok, cfg, placeholder_id, "eval set") if run.eval_rows else None
        if held is not None and held.soft != train.soft:
            raise DataError(f"--eval.dataset {cfg.eval.dataset}: its step labels are "
                            f"{'probabilities' if held.soft else 'label tokens'}, the training set's are "
                            "not; use one kind")
        if spec is None:
            info("no --model.reward_tokens: the PRM is trained over the whole vocabulary and its folder gets "
                 "no prm.json; to score steps in RL pass --reward.prm_reward_tokens (good first)")
        objective = PRMObjective(tok.pad_token_id, cfg.ds.packing_samples, placeholder_id, reward_ids,
                                 soft=train.soft)
        export = ExportHooks(extras=None if spec is None else lambda folder: save_prm_spec(folder, spec))
        return run.fit(objective, train.items, held.items if held is not None else None, export=export)
