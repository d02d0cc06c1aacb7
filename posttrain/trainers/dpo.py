"""Direct preference optimisation (DPO / IPO / cDPO) against a frozen reference model, and the
reference-free ORPO / SimPO / CPO (`--model.loss_type`).

For each pair, with summed response log-probs (prompt tokens masked: ``loss_mask[:, 1:]``)
``π_c, π_r`` of the policy and ``ref_c, ref_r`` of the reference, ``h = (π_c - π_r) - (ref_c - ref_r)``,
and the token means ``a = π / |y|``:

    ℓ_dpo  = -(1-ε) logσ(βh) - ε logσ(-βh)       (ε = --model.label_smoothing, cDPO)
    ℓ_ipo  = (h - 1/(2β))²                        (--model.ipo_enable / --model.loss_type ipo)
    ℓ_orpo = -λ logσ(log odds(y_c) - log odds(y_r)), log odds(y) = a - log(1 - e^a)  (λ: orpo_lambda)
    ℓ_simpo = -(1-ε) logσ(β(a_c - a_r) - γ) - ε logσ(γ - β(a_c - a_r))               (γ: simpo_gamma)
    ℓ_cpo  = -(1-ε) logσ(β(π_c - π_r)) - ε logσ(-β(π_c - π_r))
    ℓ_nll  = -(1/|y_c|) Σ_t log π(y_c,t | ·) = -a_c   (token mean over the chosen response)

The step loss is ``Σ_pairs (ℓ + c·ℓ_nll) / P`` with ``c`` = 1 for ORPO, --model.cpo_alpha for CPO and
--model.nll_loss_coef otherwise, and ``P`` the pairs of the whole optimizer step (all micro-batches, all
ranks), so the split does not change it. At initialisation (policy = reference) ``h = 0`` and the DPO
loss is log 2. ORPO, SimPO and CPO read the policy alone: no reference model is loaded or run.

Logged per pair (means): ``loss`` (ℓ + c·ℓ_nll), the term ℓ (``dpo_loss``; ``or_loss``, ``simpo_loss``,
``cpo_loss``), ``nll``, ``chosen_reward`` and ``rejected_reward`` (β(π - ref); SimPO β·a, CPO β·π,
ORPO λ·a), ``margin`` = chosen_reward - rejected_reward, ``acc`` = share of pairs with chosen_reward >
rejected_reward, and for ORPO ``log_odds_ratio``.

The reference model: `trainers.reference` (the policy's initial weights by default; with LoRA the policy
with its adapters disabled; offloaded or held as ZeRO-3 shards).

Vision-language models: a pair's prompt images (the ``--data`` image flags)
go with both of its sequences (`pair_sides`), and the policy and the reference read the same batch, image
tensors included; the log-ratios still cover the response tokens only.
"""
from __future__ import annotations

import torch

from posttrain.algorithms.preference import cpo_loss, dpo_loss, orpo_loss, simpo_loss
from posttrain.config import DPOConfig
from posttrain.config.roles import REFERENCE_FREE_LOSSES
from posttrain.trainers.pairs import PairObjective, preference_items
from posttrain.trainers.reference import ReferenceForward, load_reference
from posttrain.trainers.session import SingleModelRun
from posttrain.utils.log import info

TERM_NAMES = {"sigmoid": "dpo_loss", "ipo": "dpo_loss", "orpo": "or_loss", "simpo": "simpo_loss",
              "cpo": "cpo_loss"}


def effective_loss(loss_type: str, ipo: bool) -> str:
    """The loss a DPO run trains with: `ipo=True` (--model.ipo_enable) is `loss_type="ipo"`."""
    return "ipo" if ipo else loss_type


class DPOObjective(PairObjective, ReferenceForward):
    """The `Objective` of the step loop for DPO and its reference-free relatives (pairs as units, see
    `PairObjective`). `ipo=True` is `loss_type="ipo"`; a reference-free loss (`REFERENCE_FREE_LOSSES`)
    never touches `ref_model`."""

    name = "DPO"

    def __init__(self, *, pad_id: int, packing: bool, beta: float = 0.1, label_smoothing: float = 0.0,
                 ipo: bool = False, nll_loss_coef: float = 0.0, loss_type: str = "sigmoid",
                 orpo_lambda: float = 0.1, simpo_gamma: float = 0.5, cpo_alpha: float = 1.0, ref_model=None,
                 ref_offload: bool = False, device=None) -> None:
        PairObjective.__init__(self, pad_id, packing)
        ReferenceForward.__init__(self, ref_model, ref_offload, device)
        if loss_type not in TERM_NAMES:
            raise ValueError(f"loss_type={loss_type!r}: expected one of {', '.join(TERM_NAMES)}")
        self.loss_type = effective_loss(loss_type, ipo)
        self.reference_free = self.loss_type in REFERENCE_FREE_LOSSES
        self.beta, self.label_smoothing = beta, label_smoothing
        self.orpo_lambda, self.simpo_gamma = orpo_lambda, simpo_gamma
        self.nll_coef = {"orpo": 1.0, "cpo": cpo_alpha}.get(self.loss_type, nll_loss_coef)

    def preference_term(self, logps, counts, ref_logps, b: int):
        """(the mean term ℓ over the B pairs, chosen rewards [B], rejected rewards [B], extra stat sums)
        from the summed response log-probs `logps` [2B] (chosen rows first), their token `counts` and the
        reference's `ref_logps` (None for a reference-free loss)."""
        avg = logps / counts.clamp(min=1)  # token means a
        if self.loss_type == "orpo":
            term, chosen_r, rejected_r, log_odds = orpo_loss(avg[:b], avg[b:], lam=self.orpo_lambda)
            return term, chosen_r, rejected_r, {"log_odds_ratio_sum": float(log_odds.sum())}
        if self.loss_type == "simpo":
            return (*simpo_loss(avg[:b], avg[b:], beta=self.beta, gamma=self.simpo_gamma,
                                label_smoothing=self.label_smoothing), {})
        if self.loss_type == "cpo":
            return (*cpo_loss(logps[:b], logps[b:], beta=self.beta, label_smoothing=self.label_smoothing), {})
        return (*dpo_loss(logps[:b], logps[b:], ref_logps[:b], ref_logps[b:], beta=self.beta,
                          label_smoothing=self.label_smoothing, ipo=self.loss_type == "ipo"), {})

    def loss(self, model, batch: dict, num_units: float):
        b = batch["num_pairs"]
        logps, counts, ref_logps = self.logps_with_reference(model, batch, reference=not self.reference_free)
        mean_loss, chosen_r, rejected_r, extra = self.preference_term(logps, counts, ref_logps, b)
        nll = -logps[:b] / counts[:b].clamp(min=1)  # token mean per chosen response [B]
        loss = (mean_loss * b + self.nll_coef * nll.sum()) / num_units
        with torch.no_grad():
            term_sum, nll_sum = float(mean_loss) * b, float(nll.sum())
            stats = {"loss_sum": term_sum + self.nll_coef * nll_sum,
                     f"{TERM_NAMES[self.loss_type]}_sum": term_sum,
                     "nll_sum": nll_sum, "acc_sum": float((chosen_r > rejected_r).sum()),
                     "chosen_reward_sum": float(chosen_r.sum()),
                     "rejected_reward_sum": float(rejected_r.sum()),
                     "margin_sum": float((chosen_r - rejected_r).sum()), **extra}
            stats.update({k[: -len("_sum")] + "_count": float(b) for k in list(stats)})
        return loss, stats


def train_dpo(cfg: DPOConfig) -> dict:
    """Run DPO / IPO / cDPO / ORPO / SimPO / CPO as configured (the flags validated: `config.validate`);
    returns the final eval metrics (empty without an eval set)."""
    with SingleModelRun(cfg) as run:  # a failure before training leaves no run files
        tok = run.tokenizer
        train_items = preference_items(run.train_rows, tok, cfg, "train set", processor=run.processor)
        eval_items = preference_items(run.eval_rows, tok, cfg, "eval set", processor=run.processor) \
            if run.eval_rows else None
        m = cfg.model
        reference_free = effective_loss(m.loss_type, m.ipo_enable) in REFERENCE_FREE_LOSSES
        if reference_free:
            info(f"no reference model: --model.loss_type {m.loss_type} is reference-free")
        objective = DPOObjective(pad_id=tok.pad_token_id, packing=cfg.ds.packing_samples, beta=m.beta,
                                 label_smoothing=m.label_smoothing, ipo=m.ipo_enable, loss_type=m.loss_type,
                                 nll_loss_coef=m.nll_loss_coef, orpo_lambda=m.orpo_lambda,
                                 simpo_gamma=m.simpo_gamma, cpo_alpha=m.cpo_alpha,
                                 ref_model=None if reference_free else load_reference(cfg, run.device,
                                                                                      run.world_size),
                                 ref_offload=cfg.ref.offload, device=run.device)
        return run.fit(objective, train_items, eval_items)
