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

Reference: ``--ref.model_name_or_path`` (default: the policy's initial weights). With LoRA and the
default reference no second copy is loaded: the reference is the policy with its adapters disabled
(the frozen base weights). ``--ref.offload`` keeps a separate reference on the CPU between forwards.
With ``--ds.zero_stage 3`` over several ranks a separate reference is held as ZeRO-3 shards
(``engines.zero3.FrozenShards``, loaded straight into them); ``--ref.offload`` then keeps the shards in
CPU memory (DeepSpeed's ``offload_param``, on GPUs).

Vision-language models: a pair's prompt images (the ``--data`` image flags)
go with both of its sequences (`pair_sides`), and the policy and the reference read the same batch, image
tensors included; the log-ratios still cover the response tokens only.
"""
from __future__ import annotations

import torch

from posttrain.algorithms.preference import dpo_loss
from posttrain.config import DPOConfig
from posttrain.models import forward_logits, sequence_logprobs, unwrap_model
from posttrain.models.context_parallel import slice_context
from posttrain.models.setup import ModelSetup
from posttrain.trainers.frozen import frozen_logits, load_frozen
from posttrain.trainers.pairs import PairObjective, preference_items
from posttrain.trainers.session import SingleModelRun
from posttrain.utils.log import info


class DPOObjective(PairObjective):
    """The `Objective` of the step loop for DPO (pairs as units, see `PairObjective`)."""

    def __init__(self, *, pad_id: int, packing: bool, beta: float = 0.1, label_smoothing: float = 0.0,
                 ipo: bool = False, nll_loss_coef: float = 0.0, ref_model=None, ref_offload: bool = False,
                 device=None) -> None:
        super().__init__(pad_id, packing)
        self.beta, self.label_smoothing, self.ipo, self.nll_coef = beta, label_smoothing, ipo, nll_loss_coef
        self.ref_model, self.ref_offload = ref_model, ref_offload
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    @torch.no_grad()
    def reference_logits(self, model, batch: dict) -> torch.Tensor:
        """Float32 logits of the reference: the separate reference model, or (LoRA with the default
        reference) the policy with its adapters disabled, in eval mode."""
        if self.ref_model is None:
            peft_model = unwrap_model(model)
            if not hasattr(peft_model, "disable_adapter"):
                raise ValueError("DPOObjective: ref_model=None needs a LoRA (peft) policy whose adapters can "
                                 "be disabled; pass a reference model")
            was_training = peft_model.training
            peft_model.eval()
            try:
                with peft_model.disable_adapter():
                    return forward_logits(model, batch)
            finally:
                peft_model.train(was_training)
        return frozen_logits(self.ref_model, batch, self.ref_offload, self.device)

    def loss(self, model, batch: dict, num_units: float):
        b = batch["num_pairs"]
        with slice_context(batch):  # a context-parallel slice: both forwards under one set-up of its group
            ref_logits = self.reference_logits(model, batch)
            ref_vocab = ref_logits.shape[-1]
            ref_logps = sequence_logprobs(ref_logits, batch)[0]
            del ref_logits
            logits = forward_logits(model, batch)
        if logits.shape[-1] != ref_vocab:
            raise ValueError(f"--ref.model_name_or_path: the reference has a vocabulary of {ref_vocab} "
                             f"tokens, the policy {logits.shape[-1]}; DPO needs both to share the tokenizer")
        logps, counts = sequence_logprobs(logits, batch)
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


def load_reference(cfg: DPOConfig, device: torch.device, world_size: int = 1):
    """The frozen reference model, or None when it is the LoRA policy with adapters disabled (LoRA on
    and no other `--ref.model_name_or_path` than the policy's). With --ds.zero_stage 3 over several
    ranks it loads straight into shards and is returned as a `FrozenShards` (whose forwards every rank
    runs together: the step loop pads ranks to the same number of micro-batches, and each calls `loss`)."""
    path = cfg.ref.model_name_or_path or cfg.model.model_name_or_path
    setup = ModelSetup.of(cfg)
    if setup.lora is not None and path == cfg.model.model_name_or_path:
        info("reference model: the policy with its LoRA adapters disabled (no second copy loaded)")
        if cfg.ref.offload:
            info("note: --ref.offload has nothing to offload (the reference shares the policy's base "
                 "weights)")
        return None
    return load_frozen(cfg, path, "reference model", offload=cfg.ref.offload, device=device,
                       world_size=world_size)


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
