"""Direct preference optimisation (DPO / IPO / cDPO) against a frozen reference model.

For each pair, with summed response log-probs (prompt tokens masked: ``loss_mask[:, 1:]``)
``π_c, π_r`` of the policy and ``ref_c, ref_r`` of the reference, and ``h = (π_c - π_r) - (ref_c - ref_r)``:

    ℓ_dpo  = -(1-ε) logσ(βh) - ε logσ(-βh)       (ε = --model.label_smoothing, cDPO)
    ℓ_ipo  = (h - 1/(2β))²                        (--model.ipo_enable)
    ℓ_nll  = -(1/|y_c|) Σ_t log π(y_c,t | ·)      (token mean over the chosen response)

The step loss is ``Σ_pairs (ℓ + c·ℓ_nll) / P`` with ``c = --model.nll_loss_coef`` and ``P`` the pairs of
the whole optimizer step (all micro-batches, all ranks), so the split does not change it. At
initialisation (policy = reference) ``h = 0`` and the DPO loss is log 2.

Logged per pair (means): ``loss`` (ℓ + c·ℓ_nll), ``dpo_loss`` (ℓ), ``nll``, ``chosen_reward`` = β(π_c -
ref_c), ``rejected_reward`` = β(π_r - ref_r), ``margin`` = chosen_reward - rejected_reward and ``acc`` =
share of pairs with chosen_reward > rejected_reward.

The reference model: `trainers.reference` (the policy's initial weights by default; with LoRA the policy
with its adapters disabled; offloaded or held as ZeRO-3 shards).

Vision-language models: a pair's prompt images (the ``--data`` image flags)
go with both of its sequences (`pair_sides`), and the policy and the reference read the same batch, image
tensors included; the log-ratios still cover the response tokens only.
"""
from __future__ import annotations

import torch

from posttrain.algorithms.preference import dpo_loss
from posttrain.config import DPOConfig
from posttrain.trainers.pairs import PairObjective, preference_items
from posttrain.trainers.reference import ReferenceForward, load_reference
from posttrain.trainers.session import SingleModelRun


class DPOObjective(PairObjective, ReferenceForward):
    """The `Objective` of the step loop for DPO (pairs as units, see `PairObjective`)."""

    name = "DPO"

    def __init__(self, *, pad_id: int, packing: bool, beta: float = 0.1, label_smoothing: float = 0.0,
                 ipo: bool = False, nll_loss_coef: float = 0.0, ref_model=None, ref_offload: bool = False,
                 device=None) -> None:
        PairObjective.__init__(self, pad_id, packing)
        ReferenceForward.__init__(self, ref_model, ref_offload, device)
        self.beta, self.label_smoothing, self.ipo, self.nll_coef = beta, label_smoothing, ipo, nll_loss_coef

    def loss(self, model, batch: dict, num_units: float):
        b = batch["num_pairs"]
        logps, counts, ref_logps = self.logps_with_reference(model, batch)
        mean_loss, chosen_r, rejected_r = dpo_loss(
            logps[:b], logps[b:], ref_logps[:b], ref_logps[b:], beta=self.beta,
            label_smoothing=self.label_smoothing, ipo=self.ipo)
        nll = -logps[:b] / counts[:b].clamp(min=1)  # token mean per chosen response [B]
        loss = (mean_loss * b + self.nll_coef * nll.sum()) / num_units
        with torch.no_grad():
            dpo_sum, nll_sum = float(mean_loss) * b, float(nll.sum())
            stats = {"loss_sum": dpo_sum + self.nll_coef * nll_sum, "dpo_loss_sum": dpo_sum,
                     "nll_sum": nll_sum, "acc_sum": float((chosen_r > rejected_r).sum()),
                     "chosen_reward_sum": float(chosen_r.sum()),
                     "rejected_reward_sum": float(rejected_r.sum()),
                     "margin_sum": float((chosen_r - rejected_r).sum())}
            stats.update({k[: -len("_sum")] + "_count": float(b) for k in list(stats)})
        return loss, stats


def train_dpo(cfg: DPOConfig) -> dict:
    """Run DPO / IPO / cDPO as configured (the flags validated: `config.validate`); returns the final eval
    metrics (empty without an eval set)."""
    with SingleModelRun(cfg) as run:  # a failure before training leaves no run files
        tok = run.tokenizer
        train_items = preference_items(run.train_rows, tok, cfg, "train set", processor=run.processor)
        eval_items = preference_items(run.eval_rows, tok, cfg, "eval set", processor=run.processor) \
            if run.eval_rows else None
        m = cfg.model
        objective = DPOObjective(pad_id=tok.pad_token_id, packing=cfg.ds.packing_samples, beta=m.beta,
                                 label_smoothing=m.label_smoothing, ipo=m.ipo_enable,
                                 nll_loss_coef=m.nll_loss_coef,
                                 ref_model=load_reference(cfg, run.device, run.world_size),
                                 ref_offload=cfg.ref.offload, device=run.device)
        return run.fit(objective, train_items, eval_items)
