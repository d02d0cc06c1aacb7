"""A hash that proves two holders of a model have exactly the same weights (trainer vs rollout engine).

`weights_hash(state)` = SHA-256 over, in name order, each tensor's `tensor_digest` = SHA-256 of its
name, dtype, shape and bytes. Two levels, so that an engine that receives the weights bucket by bucket
(and keeps them in another layout, as vLLM does) can hash what it received without keeping a copy:
`WeightsDigest.add(name, tensor)` per received tensor, then `.hexdigest()` equals `weights_hash` of the
same state dict."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch


def tensor_digest(name: str, tensor: torch.Tensor) -> str:
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class WeightsDigest:
    """Per-tensor digests of the weights received so far (a later tensor of the same name replaces one)."""

    def __init__(self) -> None:
        self.digests: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.digests[name] = tensor_digest(name, tensor)

    def hexdigest(self) -> str | None:
        """None before any weights arrived."""
        if not self.digests:
            return None
        h = hashlib.sha256()
        for name in sorted(self.digests):
            h.update(f"{name}={self.digests[name]};".encode())
        return h.hexdigest()


NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def named_tensors(state: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs of a state dict, or the pairs themselves (e.g. streamed one at a time)."""
    return state.items() if isinstance(state, Mapping) else state


def weights_hash(state: NamedTensors) -> str:
    """The hash of a state dict, or of its `(name, tensor)` pairs (consumed one at a time)."""
    digest = WeightsDigest()
    for name, tensor in named_tensors(state):
        digest.add(name, tensor)
    return digest.hexdigest() or hashlib.sha256(b"").hexdigest()
