"""``HFWeights``: the weights an HF rollout engine samples with, and every way they change.

A whole load (a state dict or another module's), a bucketed sync (``update``), and a LoRA policy's adapter
(``update_adapter``) in one of two ``lora_sync`` modes: ``merged`` (a plain model; each targeted weight is
rewritten ``W0 + s·B·A`` from a pristine copy, ``models.lora_sync.MergedBase``: the fast decode path stays,
at the memory of the copies) or ``adapter`` (the model is wrapped in peft and the adapter tensors are copied
into it: exactly the trainer's math, no copies, decode through transformers).

Every change runs inside the engine's ``PauseGate.paused()`` (between decode steps) and bumps ``epoch``, so
decode batches re-prefill their rows with the new weights; ``version`` is the trainer's policy version that
tokens sampled from now on record.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from posttrain.models import apply_lora, as_lora_spec, is_peft, unwrap_model
from posttrain.models import lora_sync as lsync
from posttrain.rollout.pause import PauseGate
from posttrain.utils.weights_hash import weights_hash

LORA_SYNC_MODES = ("merged", "adapter")


class HFWeights:
    """The engine's ``model`` (unwrapped; in ``adapter`` mode wrapped in peft here) and its weight changes.
    ``lora`` (a ``LoraSpec``-like, None/rank 0: off) and ``lora_sync`` ("merged" or "adapter", module doc):
    how a synced adapter is applied; ``lora_sync`` is None without LoRA."""

    def __init__(self, model: torch.nn.Module, gate: PauseGate, lora=None, lora_sync: str = "merged"):
        if lora_sync not in LORA_SYNC_MODES:
            raise ValueError(f"lora_sync={lora_sync!r}: valid values are {list(LORA_SYNC_MODES)}")
        model = unwrap_model(model)
        spec = as_lora_spec(lora)
        self.lora_sync = lora_sync if spec is not None else None
        self.merged = None
        if spec is not None and lora_sync == "adapter" and not is_peft(model):
            with torch.random.fork_rng(devices=[]):  # the adapter is overwritten by the first sync
                model = apply_lora(model, spec)
        elif spec is not None and lora_sync == "merged":
            if is_peft(model):
                raise ValueError("lora_sync='merged' needs a plain model (the engine merges the adapter "
                                 "itself)")
            self.merged = lsync.MergedBase(spec.scaling)
        self.model = model
        self.gate = gate
        self.epoch = 0  # bumped by every change: decode batches re-prefill their rows
        self.version = 0  # set by `updated(version)`; recorded per sampled token

    def load(self, model_or_state_dict) -> int:
        """Copy weights in (a state dict, or another module's; from a peft module: its base weights and its
        adapter); no-op when given the engine's own module. Returns the bytes copied."""
        if isinstance(model_or_state_dict, torch.nn.Module):
            src = unwrap_model(model_or_state_dict)
            if src is self.model:
                return 0
            if is_peft(src):
                base = lsync.base_pairs(src)
                self.update(base)
                return lsync.pair_bytes(base) + self.update_adapter(lsync.adapter_pairs(src))
            model_or_state_dict = src.state_dict()
        if not isinstance(model_or_state_dict, Mapping):
            raise ValueError(f"load_weights expects a torch.nn.Module or a state dict, not "
                             f"{type(model_or_state_dict).__name__}")
        if self.lora_sync is not None:  # names are the plain model's: route them as a sync would
            self.update(model_or_state_dict.items())
            return lsync.pair_bytes(model_or_state_dict.items())
        with self.gate.paused(), torch.no_grad():
            self.model.load_state_dict(model_or_state_dict, strict=True)
            self.epoch += 1
        return lsync.pair_bytes(model_or_state_dict.items())

    def sync(self, model) -> int:
        """Take ``model``'s current weights; returns the bytes copied (0 when it is the engine's module).
        From a peft module only the adapter moves (the base is the engine's since the load)."""
        src = unwrap_model(model)
        if src is not self.model and is_peft(src):
            if self.lora_sync is None:
                raise ValueError("sync_weights: the policy is a LoRA model but this engine was built "
                                 "without lora=")
            return self.update_adapter(lsync.adapter_pairs(src))
        return self.load(model)

    def _own_state(self) -> dict[str, torch.Tensor]:
        """The engine's weights under the plain model's names."""
        model = self.model
        return dict(lsync.base_pairs(model)) if is_peft(model) else model.state_dict()

    def update(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy some HF-named weights (one sync bucket) in. In merged LoRA mode a targeted weight replaces
        ``W0`` and is merged again with the current adapter."""
        own = self._own_state()
        with self.gate.paused(), torch.no_grad():
            self.epoch += 1
            for name, tensor in named:
                if name not in own:
                    raise KeyError(f"update_weights: the rollout model has no weight named {name!r}")
                if self.merged is not None and name in self.merged.base:
                    tensor = self.merged.set_base(name, tensor)
                own[name].copy_(tensor)

    def update_adapter(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Apply LoRA adapter tensors (canonical names ``{module}.lora_A.weight`` / ``.lora_B.weight``,
        ``models.lora_sync``; one sync bucket) in this ``lora_sync`` mode; returns their bytes."""
        if self.lora_sync is None:
            raise ValueError("update_adapter: this engine was built without lora= (no LoRA policy)")
        pairs = list(pairs)
        with self.gate.paused(), torch.no_grad():
            self.epoch += 1
            if self.merged is None:  # adapter mode: copy into the peft layers
                params = lsync.adapter_params(self.model)
                for name, tensor in pairs:
                    if name not in params:
                        raise KeyError(f"update_adapter: the rollout model has no adapter tensor named "
                                       f"{name!r}")
                    params[name].copy_(tensor)
            else:
                self._merge(pairs)
        return lsync.pair_bytes(pairs)

    def _merge(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Merged mode: keep each newly targeted weight's pristine ``W0``, then rewrite the merged weights."""
        own = self.model.state_dict()
        for name, _ in pairs:
            weight = f"{lsync.adapter_module(name)}.weight"
            if lsync.is_adapter_name(name) and weight not in self.merged.base:
                if weight not in own:
                    raise KeyError(f"update_adapter: the rollout model has no weight named {weight!r}")
                self.merged.keep(weight, own[weight])  # pristine: before its first merge
        for name, weight in self.merged.receive(pairs):
            own[name].copy_(weight)

    def updated(self, version: int | None = None) -> None:
        """After the last bucket of a sync: tokens sampled from now on record ``version`` (None:
        unchanged)."""
        with self.gate.paused():
            if version is not None:
                self.version = int(version)

    def hash(self) -> str:
        """`posttrain.utils.weights_hash` of the weights sampled with; with LoRA `lora_sync.lora_weights_hash`
        of base (``W0``) + adapter + scaling, as the trainer's."""
        if self.merged is not None:
            return self.merged.hash(self.model.state_dict().items())
        if is_peft(self.model):
            return lsync.model_lora_hash(self.model)
        return weights_hash(self.model.state_dict())
