"""Tensor parallelism (N ranks per model copy: `ModelSetup.tensor`) for the single-model trainers, on
DeepSpeed AutoTP.

Layout: rank = dp * N + tp; each group of N consecutive ranks holds one copy of the model split over it and
takes the same micro-batches; data parallelism runs over the groups. AutoTP (ZeRO 0/1/2) splits every decoder
layer's projections, following the model's Hugging Face tensor-parallel plan:
  - q/k/v_proj, gate/up_proj column-wise: each rank keeps a contiguous block of output rows (whole heads; the
    bias with them); the forward is the identity on the input, the backward all-reduces its gradient;
  - o_proj, down_proj row-wise: the matching input columns; the output is all-reduced, the bias added once;
  - embeddings, norms, a tied head and a score head stay whole on every rank (`vocab_parallel_lm_head` off:
    the objectives need whole logits); an untied lm_head is split column-wise with its logits gathered.
A split parameter carries `tensor_model_parallel = True`; a global gradient norm sums its squares over the
tensor-parallel group and counts a replicated parameter once, so it equals the unsplit model's.
"""
from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

from posttrain.config.validate import tensor_parallel_refusal
from posttrain.utils.errors import ConfigError

SPLIT_LAYERS = re.compile(r"(^|\.)layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
WHOLE_LAYERS = ("lm_head", "score")  # output heads: kept whole (tied) or split with gathered output (untied)


def autotp_config(size: int) -> dict:
    """The DeepSpeed config's `tensor_parallel` entry for `size` ranks per model copy."""
    return {"autotp_size": size, "vocab_parallel_lm_head": False}


def check_modules(model: torch.nn.Module, size: int) -> None:
    """Before AutoTP: every linear layer is a split decoder projection (`SPLIT_LAYERS`) or an output head;
    ConfigError naming the first other one (e.g. a vision tower's fused qkv, an MoE expert)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not SPLIT_LAYERS.search(name) \
                and name.split(".")[-1] not in WHOLE_LAYERS:
            raise ConfigError(tensor_parallel_refusal(size, f"module {name} ({type(module).__name__}) has no "
                                                      "tensor-parallel split in this version (supported: "
                                                      "self_attn.q/k/v/o_proj and mlp.gate/up/down_proj of "
                                                      "decoder layers, lm_head, score)"))


def check_split(model: torch.nn.Module) -> None:
    """After AutoTP: every decoder projection was split (else the model's plan left
    one whole: RuntimeError)."""
    for name, module in model.named_modules():
        if SPLIT_LAYERS.search(name) and not is_split(getattr(module, "weight", None)):
            raise RuntimeError(tensor_parallel_refusal(None, f"DeepSpeed AutoTP left {name} whole; this "
                                                             "model's layout is not supported"))


def is_split(param) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def grad_norm(params, group) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` (those with one), as `torch.nn.utils.get_total_norm`
    takes it (the norm of the per-tensor norms): a split tensor's norm is sqrt(Σ over the group of its shards'
    squared norms), a replicated tensor's is its own (counted once)."""
    grads = [(p.grad.detach(), is_split(p)) for p in params if p.grad is not None]
    norms = torch.stack([torch.linalg.vector_norm(g) for g, _ in grads])
    split = torch.tensor([s for _, s in grads])
    squares = norms.pow(2) * split
    dist.all_reduce(squares, group=group)
    return torch.linalg.vector_norm(torch.where(split, squares.sqrt(), norms))


def full_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor, value: torch.Tensor | None = None):
    """The whole value of `model.state_dict()[name]` (or of `value` shaped like it: its gradient),
    all-gathered from the shards when it is split (collective over the tensor-parallel group: every rank calls
    it for the same names in the same order); a new tensor, the shard is untouched (ZeRO 1/2 keep views
    into flat buffers)."""
    value = tensor if value is None else value
    if not is_split(tensor):
        return value
    module = model.get_submodule(name.rpartition(".")[0])
    row = type(module).__name__.startswith("LinearAllreduce")  # row-parallel: weight split over its inputs
    return module._all_gather_shards(value.detach(), module._partition_sizes, dim=1 if row else 0)


def elements(model: torch.nn.Module) -> tuple[int, int]:
    """(parameter elements this rank holds, of which split)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if is_split(p))


def optimizer_elements(optimizer) -> int:
    """Elements of the optimizer's state tensors (Adam: both moments) on this rank; the innermost torch
    optimizer of a DeepSpeed wrapper (ZeRO 1/2: its partition)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return sum(t.numel() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def describe(model: torch.nn.Module, full: int, size: int, optimizer=None) -> str:
    """The rank's share: `tensor parallel over N ranks: this rank holds P of F parameter elements (S split), O
    optimizer-state elements`."""
    own, split = elements(model)
    text = (f"tensor parallel over {size} ranks: this rank holds {own} of {full} parameter elements "
            f"({split} split, {math.floor(100 * own / max(full, 1))}%)")
    return (text
            + (f", {optimizer_elements(optimizer)} optimizer-state "
               f"elements" if optimizer is not None else ""))
