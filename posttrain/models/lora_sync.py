"""Adapter-only weight sync: a peft LoRA model's tensors under the base model's HF names.

Canonical names (what travels to a rollout engine):

* base tensors: the HF name of the plain model (``models.lora.base_name``; peft's ``original_module``
  copies skipped);
* adapter tensors: ``"{module}.lora_A.weight"`` [r, in] and ``"{module}.lora_B.weight"`` [out, r], with
  ``module`` the HF name of the targeted linear layer.

A targeted layer computes ``W x + s * B A x`` with ``s`` = ``scaling`` (``models.lora.lora_scalings``). An
engine that merges keeps pristine copies ``W0`` and writes ``W = W0 + s * B A`` (``MergedBase``): never
accumulated, so any number of syncs leaves ``W0`` bit-identical. ``lora_weights_hash`` covers base +
adapter + ``s``: a trainer and an engine agree on it only if they sample the same function.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

import torch

from posttrain.models.lora import base_name, lora_scalings
from posttrain.utils.weights_hash import weights_hash

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(name: str) -> bool:
    """A canonical adapter tensor name (``{module}.lora_A.weight`` / ``.lora_B.weight``)."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_module(name: str) -> str:
    """``{module}`` of a canonical adapter name."""
    return name.rsplit(".", 2)[0]


def _lora_layers(model) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF module name, peft lora layer) for every layer holding the ``default`` adapter."""
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            yield base_name(name + ".")[:-1], module


def adapter_params(model) -> dict[str, torch.Tensor]:
    """Canonical adapter name -> the live peft parameter (the engine writes into these)."""
    out = {}
    for module, layer in _lora_layers(model):
        out[f"{module}.lora_A.weight"] = layer.lora_A["default"].weight
        out[f"{module}.lora_B.weight"] = layer.lora_B["default"].weight
    return out


def canonical_name(peft_name: str) -> str | None:
    """The name a peft state-dict entry travels under (None: peft's ``original_module`` copies)."""
    for x in "AB":
        peft_name = peft_name.replace(f".lora_{x}.default.weight", f".lora_{x}.weight")
    return base_name(peft_name)


def is_peft_adapter_name(peft_name: str) -> bool:
    """A peft state-dict name of an adapter tensor (travels as ``{module}.lora_A/B.weight``)."""
    return is_adapter_name(canonical_name(peft_name) or "")


def canonical_pairs(pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """peft-named pairs (a ``state_dict``'s, possibly streamed) under their canonical names."""
    for name, tensor in pairs:
        canonical = canonical_name(name)
        if canonical is not None:
            yield canonical, tensor


def adapter_pairs(model) -> list[tuple[str, torch.Tensor]]:
    """The adapter tensors (detached, not copied) under canonical names, in name order."""
    pairs = [(n, t) for n, t in canonical_pairs(model.state_dict().items()) if is_adapter_name(n)]
    return sorted(pairs, key=lambda pair: pair[0])


def base_pairs(model) -> list[tuple[str, torch.Tensor]]:
    """Every other state tensor under its plain-model name (targeted layers: their frozen ``W0``)."""
    return [(n, t) for n, t in canonical_pairs(model.state_dict().items()) if not is_adapter_name(n)]


def pair_bytes(pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in pairs)


def adapter_bytes(model) -> int:
    """Bytes of one adapter sync: sum over the lora_A / lora_B tensors of numel * itemsize."""
    return pair_bytes(adapter_pairs(model))


def scaling(model) -> float:
    """``s`` of ``W x + s * B A x`` (``lora_scalings``: one value for every layer)."""
    values = set(lora_scalings(model).values())
    if len(values) != 1:
        raise ValueError(f"LoRA sync needs one scaling for every adapted layer, found {sorted(values)}")
    return values.pop()


def lora_weights_hash(base: Iterable[tuple[str, torch.Tensor]], adapter: Iterable[tuple[str, torch.Tensor]],
                      s: float) -> str:
    """``weights_hash`` over base + adapter + a 0-d float64 ``"lora.scaling"`` tensor."""
    scale = [("lora.scaling", torch.tensor(float(s), dtype=torch.float64))]
    return weights_hash(chain(base, adapter, scale))  # streamed: one tensor at a time


def model_lora_hash(model) -> str:
    """``lora_weights_hash`` of a peft model (the trainer's side, or an engine in adapter mode)."""
    return lora_weights_hash(base_pairs(model), adapter_pairs(model), scaling(model))


class MergedBase:
    """An engine's merged view of a LoRA policy: ``W = W0 + s * B A`` for every adapted layer.

    ``keep(name, W0)`` stores a pristine copy of a base tensor (``{module}.weight``, or any other tensor an
    engine must push again with it); ``store(pairs)`` takes adapter tensors (any split into buckets);
    ``receive(pairs)`` stores them and returns ``(weight name, merged W)`` for each module whose A and B
    are both known; ``current(name)`` is what a kept tensor must be now. Merging runs in fp32 from ``W0``
    (cast back to its dtype)."""

    def __init__(self, s: float, device: torch.device | str | None = None,
                 compute: torch.device | str | None = None) -> None:
        self.s = float(s)
        self.device = device  # where W0 is kept (None: where it came from)
        self.compute = compute  # where W0 + s·B·A is computed (None: where W0 is)
        self.base: dict[str, torch.Tensor] = {}     # "{module}.weight" -> W0
        self.adapter: dict[str, torch.Tensor] = {}  # canonical adapter name -> last received tensor

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        self.base[name] = tensor.detach().to(self.device or tensor.device, copy=True)

    def merged(self, module: str) -> torch.Tensor:
        w0 = self.base[f"{module}.weight"]
        w0 = w0 if self.compute is None else w0.to(self.compute)
        a, b = (self.adapter[f"{module}.lora_{x}.weight"].to(w0.device, torch.float32) for x in "AB")
        return (w0.float() + self.s * (b @ a)).to(w0.dtype)  # peft's own merge arithmetic

    def set_base(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A new ``W0`` for ``name``; returns what the engine's weight must become (merged when the
        module's adapter is known)."""
        self.keep(name, tensor)
        module = name[:-len(".weight")]
        if f"{module}.lora_A.weight" in self.adapter and f"{module}.lora_B.weight" in self.adapter:
            return self.merged(module).to(tensor.device)
        return tensor

    def store(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Keep adapter tensors (any split into buckets); returns the modules they belong to, in order."""
        touched = []
        for name, tensor in pairs:
            if not is_adapter_name(name):
                raise KeyError(f"update_adapter: {name!r} is not an adapter tensor (*.lora_A/B.weight)")
            self.adapter[name] = tensor.detach().to("cpu", copy=True)
            touched.append(adapter_module(name))
        return list(dict.fromkeys(touched))

    def ready(self, module: str) -> bool:
        """Both A and B of ``module`` are known; KeyError when its ``W0`` is not (no full sync yet)."""
        if not all(f"{module}.lora_{x}.weight" in self.adapter for x in "AB"):
            return False
        if f"{module}.weight" not in self.base:
            raise KeyError(f"update_adapter: no base weight {module}.weight to merge into (send the "
                           "base weights first: a full sync)")
        return True

    def receive(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``store`` the pairs; returns ``(weight name, merged W)`` of each touched module that is
        ``ready``."""
        return [(f"{m}.weight", self.merged(m)) for m in self.store(pairs) if self.ready(m)]

    def current(self, name: str) -> torch.Tensor:
        """What a kept tensor must be in the engine: ``W0 + s·B·A`` for an adapted module's weight whose
        adapter is known, else its kept copy."""
        module = name[:-len(".weight")]
        if name.endswith(".weight") and f"{module}.lora_A.weight" in self.adapter and self.ready(module):
            return self.merged(module)
        return self.base[name]

    def base_pairs(self, live: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``live`` (the engine's current weights) with each merged weight replaced by its ``W0``."""
        return [(n, self.base.get(n, t) if self._adapted(n) else t) for n, t in live]

    def _adapted(self, name: str) -> bool:
        return name.endswith(".weight") and f"{name[:-len('.weight')]}.lora_A.weight" in self.adapter

    def hash(self, live: Iterable[tuple[str, torch.Tensor]]) -> str:
        return lora_weights_hash(self.base_pairs(live), sorted(self.adapter.items()), self.s)
