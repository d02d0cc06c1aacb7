"""Knowledge distillation (offline): SFT on a dataset with a frozen teacher's next-token distributions.

On SFT's target tokens (``loss_mask[1:]``; the same samples, templates, packing and step normalisation as
`trainers/sft.py`), with ``c = --model.kd_coef`` and ``d`` the divergence chosen by ``--model.kd_loss``
(``forward`` KL(t‖s), ``reverse`` KL(s‖t) or ``jsd`` JSD_β with β = ``--model.kd_beta``; both
distributions at ``--model.kd_temperature``; `algorithms.distillation`):

    loss = (1 - c) · Σ_i m_i (−log π(x_i | x_<i)) / N  +  c · Σ_i m_i d_i / N

with ``N`` the target tokens of the whole optimizer step (all micro-batches, all ranks), so the split does
not change it; c = 0 is SFT. As OpenRLHF 0.9's train_kd (``(1 − kd_coef)·gpt_loss + kd_coef·distil_loss``).

Logged per target token: ``loss`` (the mix), ``nll``, ``kd_loss`` (d) and ``acc`` (the student's argmax is
the label). The teacher (``--teacher.model_name_or_path``) must share the student's vocabulary (checked at
start-up from both config.json files, and at the first forward); it is frozen and loaded as DPO's separate
reference (`trainers.frozen`: ``--teacher.offload``, ZeRO-3 shards with ``--ds.zero_stage 3`` over several
ranks), never trained nor checkpointed. A LoRA student trains its adapters only; the teacher is whole.
"""
from __future__ import annotations

import torch

from posttrain.algorithms.distillation import distillation_loss
from posttrain.config import KDConfig
from posttrain.models import forward_logits
from posttrain.models.context_parallel import slice_context
from posttrain.models.forward import align_next_tokens
from posttrain.trainers.frozen import frozen_logits, load_frozen
from posttrain.trainers.inputs import teacher_tokenizer_problem
from posttrain.trainers.session import SingleModelRun
from posttrain.trainers.sft import SFTObjective, sft_items
from posttrain.utils.errors import ConfigError


class KDObjective(SFTObjective):
    """The `Objective` of the step loop for KD (target tokens as units, as `SFTObjective`)."""

    def __init__(self, pad_id: int, packing: bool, *, teacher, kd_coef: float = 0.4, kd_loss: str = "forward",
                 beta: float = 0.5, temperature: float = 1.0, offload: bool = False, device=None) -> None:
        super().__init__(pad_id, packing)
        self.teacher, self.offload = teacher, offload
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.coef, self.kind, self.beta, self.temperature = kd_coef, kd_loss, beta, temperature

    def loss(self, model, batch: dict, num_units: float):
        with slice_context(batch):  # a context-parallel slice: both forwards under one set-up of its group
            teacher_logits = frozen_logits(self.teacher, batch, self.offload, self.device)
            logits = forward_logits(model, batch)
        if logits.shape[-1] != teacher_logits.shape[-1]:
            raise ValueError(f"--teacher.model_name_or_path: the teacher has a vocabulary of "
                             f"{teacher_logits.shape[-1]} tokens, the student {logits.shape[-1]}; KD needs "
                             "both to share the tokenizer")
        logits, labels, mask = align_next_tokens(logits, batch)
        teacher_logits = align_next_tokens(teacher_logits, batch)[0]
        nll, stats = self.nll(logits, labels, mask, num_units)
        kd = distillation_loss(logits, teacher_logits, mask, self.kind, self.beta, self.temperature,
                               num_tokens=num_units)
        loss = (1 - self.coef) * nll + self.coef * kd
        count = stats["loss_count"]
        nll_sum, kd_sum = stats.pop("loss_sum"), float(kd.detach()) * num_units
        stats.update(loss_sum=(1 - self.coef) * nll_sum + self.coef * kd_sum, nll_sum=nll_sum,
                     nll_count=count, kd_loss_sum=kd_sum, kd_loss_count=count)
        return loss, stats


def train_kd(cfg: KDConfig) -> dict:
    """Run KD as configured (the flags validated: `config.validate`); returns the final eval metrics (empty
    without an eval set)."""
    with SingleModelRun(cfg) as run:  # a failure before training leaves no run files
        train_items, eval_items = sft_items(run, cfg)
        m = cfg.model
        problem = teacher_tokenizer_problem(cfg.teacher.model_name_or_path, run.tokenizer, "distillation "
                                            "compares the two next-token distributions token by token: use a "
                                            "teacher of the student's tokenizer")
        if problem:
            raise ConfigError(problem)
        teacher = load_frozen(cfg, cfg.teacher.model_name_or_path, "teacher model",
                              offload=cfg.teacher.offload, device=run.device, world_size=run.world_size)
        objective = KDObjective(run.tokenizer.pad_token_id, packing=cfg.ds.packing_samples, teacher=teacher,
                                kd_coef=m.kd_coef, kd_loss=m.kd_loss, beta=m.kd_beta,
                                temperature=m.kd_temperature, offload=cfg.teacher.offload, device=run.device)
        return run.fit(objective, train_items, eval_items)
