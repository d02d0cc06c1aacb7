"""The frozen reference model of the trainers that score a policy against one (DPO, KTO): loading it
(`load_reference`) and its forward beside the policy's (`ReferenceForward`).

Reference: ``--ref.model_name_or_path`` (default: the policy's initial weights). With LoRA and the
default reference no second copy is loaded: the reference is the policy with its adapters disabled
(the frozen base weights). ``--ref.offload`` keeps a separate reference on the CPU between forwards.
With ``--ds.zero_stage 3`` over several ranks a separate reference is held as ZeRO-3 shards
(``engines.zero3.FrozenShards``, loaded straight into them); ``--ref.offload`` then keeps the shards in
CPU memory (DeepSpeed's ``offload_param``, on GPUs).
"""
from __future__ import annotations

import torch

from posttrain.config import DPOConfig, KTOConfig
from posttrain.models import forward_logits, sequence_logprobs, unwrap_model
from posttrain.models.context_parallel import slice_context
from posttrain.models.setup import ModelSetup
from posttrain.trainers.frozen import frozen_logits, load_frozen
from posttrain.utils.log import info


class ReferenceForward:
    """What an objective with a frozen reference holds (`ref_model`: a model, `FrozenShards`, or None for the
    LoRA policy with its adapters disabled; `ref_offload`; `device`) and the forwards it runs."""

    name = "the trainer"  # in the error on a vocabulary mismatch

    def __init__(self, ref_model=None, ref_offload: bool = False, device=None) -> None:
        self.ref_model, self.ref_offload = ref_model, ref_offload
        self.device = torch.device(device) if device is not None else torch.device("cpu")

    @torch.no_grad()
    def reference_logits(self, model, batch: dict) -> torch.Tensor:
        """Float32 logits of the reference: the separate reference model, or (LoRA with the default
        reference) the policy with its adapters disabled, in eval mode."""
        if self.ref_model is None:
            peft_model = unwrap_model(model)
            if not hasattr(peft_model, "disable_adapter"):
                raise ValueError(f"{type(self).__name__}: ref_model=None needs a LoRA (peft) policy whose "
                                 "adapters can be disabled; pass a reference model")
            was_training = peft_model.training
            peft_model.eval()
            try:
                with peft_model.disable_adapter():
                    return forward_logits(model, batch)
            finally:
                peft_model.train(was_training)
        return frozen_logits(self.ref_model, batch, self.ref_offload, self.device)

    def logps_with_reference(self, model, batch: dict, reference: bool = True):
        """(policy log-prob sums [N], their token counts [N], reference log-prob sums [N]) of the batch's
        sequences (`models.sequence_logprobs`), the reference's forward first (its logits freed before the
        policy's), both under one set-up of a context-parallel slice; `reference=False` (a reference-free
        loss): the policy's alone, reference sums None."""
        ref_logps = ref_vocab = None
        with slice_context(batch):
            if reference:
                ref_logits = self.reference_logits(model, batch)
                ref_vocab = ref_logits.shape[-1]
                ref_logps = sequence_logprobs(ref_logits, batch)[0]
                del ref_logits
            logits = forward_logits(model, batch)
        if ref_vocab is not None and logits.shape[-1] != ref_vocab:
            raise ValueError(f"--ref.model_name_or_path: the reference has a vocabulary of {ref_vocab} "
                             f"tokens, the policy {logits.shape[-1]}; {self.name} needs both to share the "
                             "tokenizer")
        logps, counts = sequence_logprobs(logits, batch)
        return logps, counts, ref_logps


def load_reference(cfg: DPOConfig | KTOConfig, device: torch.device, world_size: int = 1):
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
