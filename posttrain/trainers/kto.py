"""KTO (Kahneman-Tversky optimisation) on unpaired rows against a frozen reference model.

Each row is a prompt ``x``, one completion ``y`` and a label (desirable or not). With summed completion
log-probs (prompt masked) of the policy ``π`` and the reference ``ref``, ``r = π(y|x) - ref(y|x)``, and the
KL estimate ``z0 = max(0, mean over the step's rows of π(y'|x) - ref(y'|x))`` (detached) where ``y'`` is the
completion of the row before ``x``'s in the step's order (cyclic: the first row takes the last row's),
the loss of a row is (`algorithms.preference.kto_loss`)

    desirable    w_d (1 - σ(β(r - z0)))          (--model.desirable_weight, --model.beta)
    undesirable  w_u (1 - σ(β(z0 - r)))          (--model.undesirable_weight)

(``--model.loss_type apo_zero_unpaired``: ``w_d (1 - σ(βr))`` and ``w_u σ(βr)``, no KL term). The step loss
is ``Σ_rows ℓ / N`` over the ``N`` rows of the optimizer step (all micro-batches, all ranks).

The KL estimate is computed once per step, before its micro-batches run (`KTOObjective.prepare`): each rank
runs, without gradients, the policy and the reference on the mismatched sequences ``(x, y')`` of its rows of
the step, micro-batched like the rows, and the sums of ``π - ref`` and their count are all-reduced over the
ranks. The pairing follows the step's global row order, so the estimate is the same on 1 rank or N, with
any micro-batch size (TRL pairs within each device's batch, OpenRLHF 0.9 within each micro-batch). An
evaluation pairs over the evaluated rows in the same way.

Logged (means over rows): ``loss``, ``kl`` (``z0``), ``chosen_reward`` = βr over desirable rows,
``rejected_reward`` = βr over undesirable rows. At initialisation (policy = reference) ``r = z0 = 0`` and
each row's loss is half its weight.

The reference model, LoRA, offload and ZeRO-3: as DPO's (`trainers.reference`).
"""
from __future__ import annotations

import torch

from posttrain.algorithms.preference import kto_loss
from posttrain.config import KTOConfig
from posttrain.config.summary import data_parallel_size
from posttrain.data import pack_collate, pad_collate
from posttrain.data.errors import DataError
from posttrain.data.unpaired_dataset import UnpairedDataset, kl_sides, row_sides
from posttrain.trainers.pairs import tokenised_items
from posttrain.trainers.reference import ReferenceForward, load_reference
from posttrain.trainers.session import SingleModelRun
from posttrain.trainers.single_model_loop import StepRows, evaluated_rows


class KTOObjective(ReferenceForward):
    """The `Objective` of the step loop for KTO: units are rows; a micro-batch of B rows is one forward of
    B sequences (padded or packed) carrying ``desirable`` [B] (bool); `prepare` sets the step's KL estimate
    ``kl`` (unclamped; 0 for apo_zero_unpaired)."""

    name = "KTO"

    def __init__(self, *, pad_id: int, packing: bool, max_len: int, eos_id: int, beta: float = 0.1,
                 desirable_weight: float = 1.0, undesirable_weight: float = 1.0, loss_type: str = "kto",
                 ref_model=None, ref_offload: bool = False, device=None) -> None:
        super().__init__(ref_model, ref_offload, device)
        self.pad_id, self.packing, self.max_len, self.eos_id = pad_id, packing, max_len, eos_id
        self.beta, self.loss_type = beta, loss_type
        self.weights = desirable_weight, undesirable_weight
        self.kl = 0.0

    def units(self, item: dict) -> int:
        return 1

    def length(self, item: dict) -> int:
        return len(item["prompt_ids"]) + len(item["completion_ids"])

    def _collate_sides(self, sides: list[dict]) -> dict:
        return pack_collate(sides) if self.packing else pad_collate(sides, self.pad_id)

    def collate(self, items: list[dict]) -> dict:
        batch = self._collate_sides(row_sides(items))
        batch["desirable"] = torch.tensor([bool(it["label"]) for it in items])
        return batch

    def prepare(self, model, rows: StepRows) -> None:
        """The step's KL estimate (module docstring): `kl` = Σ(π(y'|x) - ref(y'|x)) / count over the ranks."""
        if self.loss_type != "kto":
            self.kl = 0.0
            return
        if len(rows.order) < 2:
            raise DataError(f"KTO: a batch of {len(rows.order)} row has no KL partner (each row's prompt is "
                            "paired with another row's completion); use at least 2 rows (--train.batch_size, "
                            "the eval set) or --model.loss_type apo_zero_unpaired")
        before = {i: rows.order[p - 1] for p, i in enumerate(rows.order)}  # p = 0 -> the last row
        sums = {"kl_sum": 0.0, "kl_count": 0.0}
        for k in range(rows.n_micro):
            group = rows.groups[k if k < len(rows.groups) else 0]  # a rank with fewer re-runs its first
            sides = kl_sides([rows.items[i] for i in group], [rows.items[before[i]] for i in group],
                             self.max_len, self.eos_id)
            logps, _, ref_logps = self.logps_with_reference(model, rows.to_device(self._collate_sides(sides)))
            if k < len(rows.groups):
                sums["kl_sum"] += float((logps - ref_logps).sum())
                sums["kl_count"] += len(group)
        sums = rows.all_reduce(sums)
        self.kl = sums["kl_sum"] / sums["kl_count"]

    def loss(self, model, batch: dict, num_units: float):
        logps, _, ref_logps = self.logps_with_reference(model, batch)
        good = batch["desirable"].to(logps.device)
        losses, rewards = kto_loss(logps, ref_logps, good, self.kl, beta=self.beta,
                                   desirable_weight=self.weights[0], undesirable_weight=self.weights[1],
                                   loss_type=self.loss_type)
        b = len(losses)
        with torch.no_grad():
            n_good = float(good.sum())
            stats = {"loss_sum": float(losses.sum()), "loss_count": float(b),
                     "kl_sum": max(self.kl, 0.0) * b, "kl_count": float(b),
                     "chosen_reward_sum": float(rewards[good].sum()), "chosen_reward_count": n_good,
                     "rejected_reward_sum": float(rewards[~good].sum()), "rejected_reward_count": b - n_good}
        return losses.sum() / num_units, stats


def unpaired_items(rows: list[dict], tokenizer, cfg: KTOConfig, what: str) -> list[dict]:
    """Items `{"prompt_ids", "completion_ids", "label"}` of `rows` under `cfg.data` (`UnpairedDataset`), with
    what was cut or dropped reported once."""
    d = cfg.data
    data = UnpairedDataset(rows, tokenizer, d.max_len, input_key=d.input_key, output_key=d.output_key,
                           label_key=d.label_key, input_template=d.input_template,
                           apply_chat_template=d.apply_chat_template)
    return tokenised_items(data, what, cfg, tokenizer)


def _check_eval_rows(n: int, dp_size: int, dataset) -> None:
    """KTO's KL estimate needs two of the rows an evaluation runs (`evaluated_rows`)."""
    evaluated = evaluated_rows(n, dp_size)
    if evaluated < 2:
        ranks = f" ({dp_size} data-parallel ranks evaluate {evaluated}: a multiple of {dp_size})" \
            if dp_size > 1 else ""
        rows = f"{n} row{'s' * (n != 1)}{ranks}"
        raise DataError(f"--eval.dataset {dataset}: {rows}, and KTO needs 2 evaluated rows for its KL "
                        "estimate (each row's prompt is paired with another row's completion); add rows")


def train_kto(cfg: KTOConfig) -> dict:
    """Run KTO as configured (the flags validated: `config.validate`); returns the final eval metrics (empty
    without an eval set)."""
    with SingleModelRun(cfg) as run:  # a failure before training leaves no run files
        tok = run.tokenizer
        train_items = unpaired_items(run.train_rows, tok, cfg, "train set")
        eval_items = unpaired_items(run.eval_rows, tok, cfg, "eval set") if run.eval_rows else None
        m = cfg.model
        if eval_items is not None and m.loss_type == "kto":
            _check_eval_rows(len(eval_items), data_parallel_size(cfg, run.world_size), cfg.eval.dataset)
        objective = KTOObjective(pad_id=tok.pad_token_id, packing=cfg.ds.packing_samples,
                                 max_len=cfg.data.max_len, eos_id=tok.eos_token_id, beta=m.beta,
                                 desirable_weight=m.desirable_weight,
                                 undesirable_weight=m.undesirable_weight, loss_type=m.loss_type,
                                 ref_model=load_reference(cfg, run.device, run.world_size),
                                 ref_offload=cfg.ref.offload, device=run.device)
        return run.fit(objective, train_items, eval_items)
