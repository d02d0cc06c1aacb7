"""A decode step for Llama-family causal LMs (llama, mistral, qwen2) that reads the model's own weights
but skips transformers' per-module machinery, for the HF engine's decode loop (`decode_batch`).

One step of B rows, one new token each, per layer (x̂ = x / rms(x), RMSNorm without its weight):
  h ← h + W_o · attn(rope(q), [K; rope(k)], [V; v]),  q|k|v = (W_qkv diag(g_in)) · ĥ     (one GEMM)
  h ← h + W_down · (silu(g) ⊙ u),                      g|u = (W_gu diag(g_post)) · ĥ     (one GEMM)
then logits = (W_lm diag(g_final)) · ĥ. The fused weights — the projections concatenated, each norm's
weight folded into the matmul after it — are built once per weight epoch (a load, sync or optimizer
step rebuilds them; `_versions`); when the model's linears compute through oneDNN
(`models/cpu_linear.OneDNNLinear`) they are kept oneDNN-packed. The path runs for fp32 models on CPU
only (`FastDecoder.usable`). Rotary angles come from the model's own rotary module (every
rope type it supports) and rotate q and k in one pass (x cos + flip(x) sin, the attention scaling folded
into the q factors); attention is two batched matmuls per layer over the keys in place with grouped
heads (no repeated K/V copies; the padding mask an additive bias of the first), and the cache
(`KVBuffer`) keeps spare columns so a step writes one column instead of re-allocating every layer's K/V.
Where the fused CPU kernels load (`cpu_kernels`), a step's element-wise work — rope, cache append and
attention; residual add with RMS scaling; silu(g) ⊙ u — runs in four kernel calls per layer instead of
~20 torch ops (`FastDecoder._fused_step`).

The logits equal the transformers forward's up to float rounding (tested against it for llama and
qwen2). `fast_decoder(model)` returns None — the engine then keeps transformers' forward — for any
other architecture, sliding-window or non-default attention layouts, tensor-parallel llama
(`pretraining_tp > 1`), adapters other than plain LoRA (a projection that is neither a plain `nn.Linear` nor
peft's LoRA layer over one, whose W0 + s·B·A is folded into the fused copy) or an attention
implementation other than sdpa / eager; and a decode batch started while a module carries forward
hooks (`FastDecoder.usable`) runs transformers' forward, so the hooks fire."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.models.cpu_linear import (
    OneDNNLinear,
    onednn_weight,
    packed_linear,
    packed_weight,
    worth_packing,
)
from posttrain.rollout.cpu import cpu_kernels

_ARCHS = ("llama", "mistral", "qwen2")
_GROWTH = 64  # spare columns allocated whenever a KVBuffer runs out
_PACK_ROWS = 128  # the batch rows oneDNN lays packed weights out for (any row count multiplies correctly)


class KVLayer:
    """One layer's keys and values [B, H_kv, capacity, D], of which the first `length` columns are used.
    `keys` / `values` are the used part; `store` (a merge or a row selection) keeps a copy with spare
    columns, so the per-step `append` writes in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.store(keys, values)

    def store(self, keys: torch.Tensor, values: torch.Tensor, spare: int = _GROWTH) -> None:
        b, h, t, d = keys.shape
        self._k = keys.new_empty(b, h, t + spare, d)
        self._v = values.new_empty(b, h, t + spare, d)
        self._k[:, :, :t] = keys
        self._v[:, :, :t] = values
        self.length = t

    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, :self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, :self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one column (`k`, `v`: [B, H_kv, D]); return the used keys and values including it."""
        stored_k, stored_v = self.grow()
        stored_k[:, :, self.length - 1] = k
        stored_v[:, :, self.length - 1] = v
        return self.keys, self.values

    def grow(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Count one more column, to be written by the caller at `length - 1`; return the contiguous
        stores [B, H_kv, capacity, D] (re-allocated with spare columns when full)."""
        if self.length == self._k.shape[2]:
            self.store(self.keys, self.values)
        self.length += 1
        return self._k, self._v


class KVBuffer:
    """A decode batch's cache for `FastDecoder`: `layers` of `KVLayer` (what `decode_batch` merges,
    selects rows of and trims, through `keys` / `values`)."""

    def __init__(self, layers: list[KVLayer]) -> None:
        self.layers = layers

    @classmethod
    def from_cache(cls, cache) -> KVBuffer:
        """Copy a transformers `DynamicCache` (after a prefill) into a buffer with spare columns."""
        return cls([KVLayer(layer.keys, layer.values) for layer in cache.layers])

    def batch_select_indices(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            layer.store(layer.keys[index], layer.values[index])


def _plain_linear(module) -> bool:
    """A projection this path multiplies: a plain linear layer, or peft's LoRA linear over one (its
    weight then folded: `_weight`)."""
    if type(module) in (torch.nn.Linear, OneDNNLinear):
        return True
    return _lora_adapters(module) is not None


def _lora_adapters(module) -> list[str] | None:
    """The active adapters of a peft LoRA linear layer over a plain linear one (plain LoRA: no DoRA, no
    bias on the adapters, not merged into the base), else None."""
    if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
        return None
    if (type(module.base_layer) not in (torch.nn.Linear, OneDNNLinear)
        or getattr(module, "merged_adapters", None)):
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    for a in active:
        if getattr(module, "use_dora", {}).get(a) or module.lora_A[a].bias is not None or \
                module.lora_B[a].bias is not None:
            return None
    return active


def _base(module):
    return module.base_layer if hasattr(module, "base_layer") else module


def _weight(module) -> torch.Tensor:
    """The weight `module` multiplies with: W, or for a LoRA layer W0 + Σ_a s_a·B_a·A_a over its active
    adapters (none while adapters are disabled)."""
    weight = _base(module).weight
    if not hasattr(module, "lora_A") or module.disable_adapters:
        return weight
    for a in _lora_adapters(module):
        weight = weight + module.scaling[a] * (module.lora_B[a].weight @ module.lora_A[a].weight)
    return weight


def _halves_share_angles(inner) -> bool:
    """Whether the rotary module gives both halves of a head the same angles (cos / sin repeated, as every
    rope type of transformers' llama-family rotary module does), which the fused kernel assumes."""
    with torch.no_grad():
        probe = inner.embed_tokens.weight.new_zeros(1, 1, 1)
        cos, sin = inner.rotary_emb(probe, torch.arange(8, device=probe.device)[None])
    half = cos.shape[-1] // 2
    return torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])


def fast_decoder(model, kernels: bool = True) -> FastDecoder | None:
    """A `FastDecoder` for `model` (the transformers causal LM, unwrapped), or None where it does not apply.
    `kernels`: use the fused CPU kernels (`cpu_kernels`) where they load; False keeps torch ops."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in _ARCHS:
        return None
    if getattr(config, "_attn_implementation", "eager") not in ("sdpa", "eager"):
        return None
    if getattr(config, "pretraining_tp", 1) != 1:
        return None
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return None
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        return None
    if getattr(config, "hidden_act", "silu") != "silu":
        return None
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if (layers is None or not hasattr(inner, "rotary_emb")
        or not _plain_linear(getattr(model, "lm_head", None))):
        return None
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        if not all(_plain_linear(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                 m.down_proj)):
            return None
    return FastDecoder(model, kernels)


class FastDecoder:
    def __init__(self, model, kernels: bool = True) -> None:
        self.model = model
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self._weight_cache: dict = {}
        self._kernels = ... if kernels else None  # ...: not loaded yet (`kernels`)

    @property
    def kernels(self) -> cpu_kernels.DecodeKernels | None:
        """The fused CPU kernels this decoder steps with, or None (torch ops): loaded on the first step, kept
        where the model's shapes and rotary module suit them."""
        if self._kernels is ...:
            loaded = cpu_kernels.load()
            suits = loaded is not None and loaded.supports(self.heads // self.kv_heads, self.head_dim)
            self._kernels = loaded if suits and _halves_share_angles(self.model.model) else None
        return self._kernels

    def release(self) -> None:
        """Drop the fused weight copies (about one more copy of the model's linear weights); the next
        step rebuilds them. For a model that trains between rollouts, whose weights change anyway."""
        self._weight_cache.clear()

    def usable(self) -> bool:
        """False for a model off the CPU (on a GPU the fused copies would double the weights' memory for
        little gain), not in fp32 or under CPU autocast (in bf16 the folded norms and scalings round
        differently from transformers' forward: greedy log-probs ~8e-3 apart), and while a hook sits on a
        module whose call this path skips (a forward hook a user or a test registered, ZeRO-3's parameter
        gathering, torch's global module hooks): transformers' forward then runs, so every hook fires. Checked
        when a decode batch starts."""
        from torch.nn.modules import module as nn_module

        weight = self.model.lm_head.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
            return False
        if any(getattr(nn_module, name, None)
               for name in ("_global_forward_pre_hooks", "_global_forward_hooks")):
            return False
        for mod in self.model.modules():
            if mod._forward_pre_hooks or mod._forward_hooks or hasattr(mod, "ds_id") or any(
                    hasattr(p, "ds_id") for p in mod.parameters(recurse=False)):
                return False
        return True

    def _weights(self, layer) -> _LayerWeights:
        """The matmul weights of a layer for this weight epoch. Rebuilt whenever a source weight (a
        projection's or a norm's) was replaced or changed in place: its `_version` counts in-place
        writes (optimizer steps, `load_state_dict`, weight syncs)."""
        a, m = layer.self_attn, layer.mlp
        parts = (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj, a.o_proj, m.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        key = _versions(parts + norms)
        cached = self._weight_cache.get(id(layer))
        if cached is None or cached[0] != key:
            order = _grouped_rows(self.heads, self.kv_heads, self.head_dim) if self.kernels else None
            cached = self._weight_cache[id(layer)] = (key,
                                                      _LayerWeights(parts, norms, self._packs(a.q_proj),
                                                                    order))
        return cached[1]

    def _head(self, model) -> _Matmul:
        """The LM head with the final norm's weight folded in."""
        modules = (model.lm_head, model.model.norm)
        key = _versions(modules)
        cached = self._weight_cache.get("lm_head")
        if cached is None or cached[0] != key:
            head = _Matmul([model.lm_head], self._packs(model.lm_head), model.model.norm.weight)
            cached = self._weight_cache["lm_head"] = (key, head)
        return cached[1]

    @staticmethod
    def _packs(module) -> bool:
        """oneDNN-packed weights for a model whose linears compute through oneDNN (`OneDNNLinear`)."""
        return isinstance(_base(module), OneDNNLinear) and onednn_weight(_base(module).weight)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
             cache: KVBuffer) -> torch.Tensor:
        """Logits [B, V] (float32) of one new token per row: `tokens`, `positions` [B]; `mask` [B, C]
        marks the real cache columns including the new one; `cache` gains one column."""
        if self.kernels is not None:
            return self._fused_step(self.kernels, tokens, mask, positions, cache)
        inner = self.model.model
        b = tokens.shape[0]
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        nq, nkv = hq * d, hkv * d
        h = inner.embed_tokens(tokens)  # [B, H]
        cos, sin = self._rope(h, positions, inner.layers[0].self_attn.scaling)  # [B, hq + hkv, D]
        # the keys a row may attend, as an additive bias broadcast over each kv head's query group
        bias = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(mask == 0, float("-inf"))
        bias = bias[:, None, None, :].expand(b, hkv, 1, -1).reshape(b * hkv, 1, -1)
        for layer, kv in zip(inner.layers, cache.layers):
            w = self._weights(layer)
            qkv = w.qkv(_rms_scaled(h, self.eps))  # [B, nq + 2 nkv]
            qk = qkv[:, :nq + nkv].view(b, hq + hkv, d)
            flipped = qk.reshape(b, hq + hkv, 2, d // 2).flip(2).reshape(b, hq + hkv, d)
            qk = torch.addcmul(qk * cos, flipped, sin)  # rope; the q heads also carry the attention scaling
            keys, values = kv.append(qk[:, hq:], qkv[:, nq + nkv:].view(b, hkv, d))  # [B, hkv, C, D]
            q = qk[:, :hq].reshape(b * hkv, hq // hkv, d)  # query head kv * group + j: [B hkv, group, D]
            scores = torch.baddbmm(bias, q, keys.reshape(b * hkv, -1, d).transpose(1, 2))
            out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(b * hkv, -1, d))
            h = h + w.o(out.view(b, nq))
            gate, up = w.gate_up(_rms_scaled(h, self.eps)).chunk(2, dim=-1)
            h = h + w.down(F.silu(gate).mul_(up))
        return self._head(self.model)(_rms_scaled(h, self.eps)).float()

    def _fused_step(self, kernels, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                    cache: KVBuffer) -> torch.Tensor:
        """`step` with the fused kernels: per layer, four GEMMs and four kernel calls — rope + cache append +
        attention (q|k|v rows grouped per kv head, `_grouped_rows`), the residual add with the next
        RMS scaling (twice), silu(g) ⊙ u. `h` (the embedding output, a fresh tensor) is updated in place."""
        inner = self.model.model
        b, d = tokens.shape[0], self.head_dim
        h = inner.embed_tokens(tokens)  # [B, H]
        cos, sin = inner.rotary_emb(h[:, None], positions[:, None])  # [B, 1, D], the two halves equal
        cos, sin = cos[:, 0, :d // 2].contiguous(), sin[:, 0, :d // 2].contiguous()
        scaling = inner.layers[0].self_attn.scaling
        mask = mask.to(torch.int64).contiguous()
        scores = h.new_empty(b * self.heads * mask.shape[1])
        x = kernels.rms_scaled(h, self.eps)
        for layer, kv in zip(inner.layers, cache.layers):
            w = self._weights(layer)
            keys, values = kv.grow()
            attended = kernels.attention(w.qkv(x), cos, sin, scaling, keys, values, kv.length, mask, scores,
                                         self.kv_heads, d)
            x = kernels.residual_rms(h, w.o(attended), self.eps)  # h += o; x = h / rms(h)
            x = kernels.residual_rms(h, w.down(kernels.silu_mul(w.gate_up(x))), self.eps)
        return self._head(self.model)(x).float()

    def _rope(self, h: torch.Tensor, positions: torch.Tensor,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary angles for `positions`, as factors for x ↦ x cos + flip(x) sin over the
        q|k heads [B, hq + hkv, D] (flip swaps the two halves of a head, the sign of rotate-half sits in
        sin; the q heads' factors carry the attention scaling)."""
        cos, sin = self.model.model.rotary_emb(h[:, None], positions[:, None])  # [B, 1, D]
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        scale = torch.ones(self.heads + self.kv_heads, 1, dtype=cos.dtype, device=cos.device)
        scale[:self.heads] = scaling
        return cos * scale, sin * scale


def _grouped_rows(heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """The q|k|v output rows reordered per kv head — its group's q heads, its k, its v — for the fused
    kernel (each (row, kv head) reads one contiguous block)."""
    group, nq, nkv = heads // kv_heads, heads * head_dim, kv_heads * head_dim
    blocks = []
    for h in range(kv_heads):
        blocks += [torch.arange(h * group * head_dim, (h + 1) * group * head_dim),
                   torch.arange(nq + h * head_dim, nq + (h + 1) * head_dim),
                   torch.arange(nq + nkv + h * head_dim, nq + nkv + (h + 1) * head_dim)]
    return torch.cat(blocks)


def _versions(modules) -> tuple:
    """Where each parameter (weight, bias; a LoRA layer's base and adapters) of `modules` lives and how
    often it was written in place, and whether LoRA adapters are switched off: a changed key means a
    changed weight. (A write through `.data` does not count; torch's optimizers, weight syncs and
    `load_state_dict` write the tensors themselves.)"""
    return tuple((t.data_ptr(), t._version) for m in modules for t in m.parameters()) + tuple(
        (m.disable_adapters, tuple(m.active_adapters)) for m in modules if hasattr(m, "lora_A"))


def _rms_scaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) per row: RMSNorm without its weight, which the next matmul holds."""
    mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1])
    return x * mean_square.add_(eps).rsqrt_()


class _Matmul:
    """x ↦ x (W diag(g))ᵀ + b for the weights W of `modules` stacked along the output dimension (one GEMM
    for several projections of the same input), the preceding RMSNorm's weight g (if any) and the output
    rows taken in `order` (default: as stacked); oneDNN-packed (`packed`) or dense for `F.linear`. A copy,
    taken when built: `FastDecoder` rebuilds it when a source weight changes."""

    def __init__(self, modules, packed: bool, norm_weight: torch.Tensor | None = None,
                 order: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            weight = torch.cat([_weight(m) for m in modules])
            if norm_weight is not None:
                weight = weight * norm_weight[None, :]
            biases = [_base(m).bias for m in modules]
            bias = None if biases[0] is None else torch.cat(biases).detach()
            if order is not None:
                order = order.to(weight.device)
                weight, bias = weight[order], None if bias is None else bias[order]
        self.packed = packed and worth_packing(weight)
        self.weight = packed_weight(weight, _PACK_ROWS) if self.packed else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class _LayerWeights:
    """A decoder layer's projections as four `_Matmul`s: q|k|v fused (with the input norm's weight, its
    output rows in `qkv_order`), o, gate|up fused (with the post-attention norm's weight), down."""

    def __init__(self, parts, norms, packed: bool, qkv_order: torch.Tensor | None = None) -> None:
        q, k, v, gate, up, o, down = parts
        attn_norm, mlp_norm = (n.weight for n in norms)
        self.qkv = _Matmul([q, k, v], packed, attn_norm, qkv_order)
        self.gate_up = _Matmul([gate, up], packed, mlp_norm)
        self.o, self.down = _Matmul([o], packed), _Matmul([down], packed)
