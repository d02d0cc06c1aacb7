"""fp32 linear layers on CPU through oneDNN instead of torch's default BLAS call.

torch's CPU `F.linear` in fp32 calls MKL's sgemm. On CPUs where MKL does not take its fastest path
(seen: an AMD EPYC with AVX-512, where MKL runs its AVX2 kernels) oneDNN's matmul — the library
torch already ships for its bf16 and mkldnn paths — is 1.2–1.6x faster on the shapes a decoder
layer has (2 cores, [128, 384] x [384, 2048]: 124 → 207 GFLOP/s; a 2048² matmul 155 → 224).
Both compute y = x Wᵀ + b in IEEE fp32; they differ only in summation order (~1e-6 relative).

`use_onednn_linears(model)` turns every plain `nn.Linear` of a model into a `OneDNNLinear` (the same
module, parameters and state dict; only `forward` differs). Its forward takes oneDNN when the
weight is an fp32 CPU tensor, the input is fp32 and CPU autocast is off, and otherwise is
`nn.Linear.forward` unchanged: on CUDA, in bf16/fp16, and for DeepSpeed ZeRO-3 partitioned weights
(`ds_id`), whose gathering DeepSpeed hooks into `F.linear`. With gradients, `onednn_linear` is an
autograd function:
    y = x Wᵀ + b (oneDNN),  ∂x = ∂y W (oneDNN),  ∂W = ∂yᵀ x (torch's matmul),  ∂b = Σ_rows ∂y.
`packed_weight(W)` is oneDNN's blocked copy of W for repeated no-grad calls (the rollout engine's
decode step); `packed_linear(x, P, b)` multiplies with it. `--ds.no_onednn_linear` keeps torch's
`F.linear` everywhere.

Which path is faster depends on the shape (`bench/linear_paths.py`, bench/RESULTS.md): oneDNN with a
dense weight re-lays the weight out on every call (~15-25 µs), so it loses on small matmuls and wins on
large ones; a packed weight has no such cost but still loses on the smallest weights. A micro-benchmark
of one matmul does not settle it: whole training steps (`bench/sft.py`, `bench/dpo.py`) read slower with
oneDNN on layers that measured faster alone (a model's thin layers, the vocabulary head at ~180 rows),
so the rule follows whole-step measurements. A `OneDNNLinear` takes oneDNN (`worth_onednn`) when both
sides of its weight have at least `ONEDNN_MIN_SIDE` features and the matmul has at least
`ONEDNN_MIN_MACS` multiply-adds (rows x in x out), and never for the model's output embedding (the LM
head: 5-6% slower per step at small and base, `use_onednn_linears` marks it); the decode step packs a
weight both of whose sides have at least `ONEDNN_MIN_SIDE` features (`worth_packing`), the LM head included.
So a model whose hidden size is below 256 (the nano and tiny presets) computes exactly as with
`--ds.no_onednn_linear`; at the small and base presets SFT, DPO and the RL step measured faster. The rule
reads only shapes, so a run takes the same path for the same batch every time (resumed
runs stay bit-exact)."""
from __future__ import annotations

import torch
from torch import nn

ONEDNN_MIN_SIDE = 256  # min(in, out): thinner layers (nano/tiny presets, k/v) measured slower per whole step
ONEDNN_MIN_MACS = 2**25  # rows x in x out: below it the per-call weight re-layout costs more than it saves


def worth_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether oneDNN (dense weight) is faster than `F.linear` for `x` [..., in] and `weight` [out, in]."""
    return min(weight.shape) >= ONEDNN_MIN_SIDE and x.numel() * weight.shape[0] >= ONEDNN_MIN_MACS


def worth_packing(weight: torch.Tensor) -> bool:
    """Whether a packed copy of `weight` [out, in] multiplies faster than `F.linear` in a decode step (the
    nano/tiny presets' packed layers measured as fast or slower in whole generation steps)."""
    return min(weight.shape) >= ONEDNN_MIN_SIDE


def onednn_available() -> bool:
    """True when this torch build carries oneDNN's linear op (CPU builds on x86 and arm64 do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ + b by oneDNN; `weight` [N, K] dense (any strides) or packed (`packed_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)  # x only for ∂W
        ctx.has_bias = bias is not None
        return _matmul(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable  # a double backward raises instead of returning zeros
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _matmul(grad, weight.t(), None)
        rows = grad.reshape(-1, n)
        if ctx.needs_input_grad[1]:
            grad_w = rows.t() @ x.reshape(-1, k)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


def onednn_weight(weight: torch.Tensor) -> bool:
    """Whether oneDNN multiplies by `weight`: a 2-D fp32 CPU tensor that is not a ZeRO-3 partition."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and not hasattr(weight, "ds_id"))


def takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `onednn_linear` computes x Wᵀ + b with oneDNN (else it is `F.linear`)."""
    return onednn_weight(weight) and x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by oneDNN where `takes_onednn` (differentiable in x, W and b)."""
    if not takes_onednn(x, weight):
        return nn.functional.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return _matmul(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose forward is `onednn_linear` where `worth_onednn`, else `F.linear` (module
    docstring). `output_head` (set by `use_onednn_linears` on the model's output embedding) keeps
    `F.linear` in the forward; the decode step still packs that weight."""

    output_head = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.output_head and worth_onednn(x, self.weight):
            return onednn_linear(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Make every plain `nn.Linear` in `model` a `OneDNNLinear`, in place; returns how many. A no-op
    (0) when `onednn_available()` is False. Subclasses of `nn.Linear` (quantized layers, adapters'
    wrappers) keep their own forward; an adapter's inner plain layers are converted. The model's output
    embedding (`get_output_embeddings()`), when converted, is marked `output_head`."""
    if not onednn_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = OneDNNLinear
            count += 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, OneDNNLinear):
        head.output_head = True
    return count


def packed_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """oneDNN's blocked layout of `weight` [N, K] (fp32, CPU) for inputs of about `rows` rows; a copy
    (it does not follow later changes of `weight`). Multiply with `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x Wᵀ + b for W given by `packed_weight` (no gradient)."""
    return _matmul(x, packed, None if bias is None else bias.detach())
