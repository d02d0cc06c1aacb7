"""A decode step for Llama-family causal LMs (llama, mistral, qwen2) that reads the model's own weights
but skips transformers' per-module machinery, for the HF engine's decode loop (`decode_batch`).

One step of B rows, one new token each, per layer:
  h ← h + W_o · attn(rope(q), [K; rope(k)], [V; v]),  q|k|v = W_qkv · rms_norm(h)   (one GEMM)
  h ← h + W_down · (silu(g) ⊙ u),                      g|u = W_gu · rms_norm(h)      (one GEMM)
then logits = W_lm · rms_norm(h). The fused weights `W_qkv` / `W_gu` are concatenated from the modules'
weights once per weight epoch (a load, sync or optimizer step bumps it); when the model's linears compute
through oneDNN (`models/cpu_linear.OneDNNLinear`) every projection and the LM head are kept as oneDNN-packed
copies instead (on CPU the engine then holds a second copy of the weights). Rotary angles come from the model's own
rotary module (every rope type it supports), RMSNorm is torch's fused kernel, attention is sdpa over
the keys in place with grouped heads (no repeated K/V copies), and the cache (`KVBuffer`) keeps spare
columns so a step writes one column instead of re-allocating every layer's K/V.

The logits equal the transformers forward's up to float rounding (tested against it for llama and
qwen2). `fast_decoder(model)` returns None — the engine then keeps transformers' forward — for any
other architecture, sliding-window or non-default attention layouts, tensor-parallel llama
(`pretraining_tp > 1`), adapters (a projection that is not a plain `nn.Linear`) or an attention
implementation other than sdpa / eager; and a decode batch started while a module carries forward
hooks (`FastDecoder.usable`) runs transformers' forward, so the hooks fire."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.models.cpu_linear import OneDNNLinear, onednn_weight, packed_linear, packed_weight

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
        """Write one column ([B, H_kv, 1, D]); return the used keys and values including it."""
        if self.length == self._k.shape[2]:
            self.store(self.keys, self.values)
        self._k[:, :, self.length] = k[:, :, 0]
        self._v[:, :, self.length] = v[:, :, 0]
        self.length += 1
        return self.keys, self.values


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
    return type(module) in (torch.nn.Linear, OneDNNLinear)


def fast_decoder(model) -> FastDecoder | None:
    """A `FastDecoder` for `model` (the transformers causal LM, unwrapped), or None where it does not apply."""
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
    if layers is None or not hasattr(inner, "rotary_emb") or not _plain_linear(getattr(model, "lm_head", None)):
        return None
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        if not all(_plain_linear(x) for x in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                                 m.down_proj)):
            return None
    return FastDecoder(model)


class FastDecoder:
    def __init__(self, model) -> None:
        self.model = model
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self._weight_cache: dict = {}

    def usable(self) -> bool:
        """False while a hook sits on a module whose call this path skips (a forward hook a user or a
        test registered, ZeRO-3's parameter gathering, torch's global module hooks): transformers'
        forward then runs, so every hook fires. Checked when a decode batch starts."""
        from torch.nn.modules import module as nn_module

        if any(getattr(nn_module, name, None) for name in ("_global_forward_pre_hooks", "_global_forward_hooks")):
            return False
        for mod in self.model.modules():
            if mod._forward_pre_hooks or mod._forward_hooks or hasattr(mod, "ds_id") or any(
                    hasattr(p, "ds_id") for p in mod.parameters(recurse=False)):
                return False
        return True

    def _weights(self, layer) -> _LayerWeights | None:
        """The matmul weights of a layer for this weight epoch, or None on CUDA (fusing would copy weights
        for little gain; the modules run). Rebuilt whenever a source weight was replaced or changed in
        place (its `_version` counts in-place writes: optimizer steps, `load_state_dict`, weight syncs)."""
        a, m = layer.self_attn, layer.mlp
        parts = (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj, a.o_proj, m.down_proj)
        if parts[0].weight.device.type != "cpu":
            return None
        key = _versions(parts)
        cached = self._weight_cache.get(id(layer))
        if cached is None or cached[0] != key:
            cached = self._weight_cache[id(layer)] = (key, _LayerWeights(parts, self._packs(a.q_proj)))
        return cached[1]

    def _head(self, lm_head) -> _Matmul:
        key = _versions([lm_head])
        cached = self._weight_cache.get("lm_head")
        if cached is None or cached[0] != key:
            cached = self._weight_cache["lm_head"] = (key, _Matmul([lm_head], self._packs(lm_head)))
        return cached[1]

    @staticmethod
    def _packs(module) -> bool:
        """oneDNN-packed weights for a model whose linears compute through oneDNN (`OneDNNLinear`)."""
        return isinstance(module, OneDNNLinear) and onednn_weight(module.weight)

    def step(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: KVBuffer) -> torch.Tensor:
        """Logits [B, V] (float32) of one new token per row: `tokens`, `positions` [B]; `mask` [B, C]
        marks the real cache columns including the new one; `cache` gains one column."""
        inner = self.model.model
        b = tokens.shape[0]
        nq, nkv, d = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        group = self.heads // self.kv_heads
        h = inner.embed_tokens(tokens)[:, None]  # [B, 1, H]
        cos, sin = inner.rotary_emb(h, positions[:, None])  # [B, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, D] against [B, heads, 1, D]
        # attention of query head kv*group + j over the keys of kv head kv: [B, kv, group, C]
        bias = torch.zeros(mask.shape, dtype=h.dtype, device=h.device).masked_fill_(mask == 0, float("-inf"))
        bias = bias[:, None, None, :]
        for layer, kv in zip(inner.layers, cache.layers):
            a, m = layer.self_attn, layer.mlp
            w = self._weights(layer)
            x = F.rms_norm(h, (h.shape[-1],), layer.input_layernorm.weight, self.eps)
            if w is not None:
                qkv = w.qkv(x)
                q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
            else:
                q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
            q = q.view(b, 1, self.heads, d).transpose(1, 2)
            k = k.view(b, 1, self.kv_heads, d).transpose(1, 2)
            v = v.view(b, 1, self.kv_heads, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = kv.append(k, v)
            scores = torch.matmul(q.reshape(b, self.kv_heads, group, d), keys.transpose(-1, -2)) * a.scaling
            out = torch.matmul(torch.softmax(scores + bias, dim=-1), values)  # [B, kv, group, D]
            out = out.reshape(b, 1, nq)
            h = h + (w.o(out) if w is not None else a.o_proj(out))
            x = F.rms_norm(h, (h.shape[-1],), layer.post_attention_layernorm.weight, self.eps)
            if w is not None:
                g, u = w.gate_up(x).chunk(2, dim=-1)
            else:
                g, u = m.gate_proj(x), m.up_proj(x)
            x = F.silu(g) * u
            h = h + (w.down(x) if w is not None else m.down_proj(x))
        h = F.rms_norm(h, (h.shape[-1],), inner.norm.weight, self.eps)
        return self._head(self.model.lm_head)(h[:, 0]).float()


def _versions(modules) -> tuple:
    """Where each weight and bias of `modules` lives and how often it was written in place: a changed
    key means a changed tensor. (A write through `.data` does not count; torch's optimizers, weight
    syncs and `load_state_dict` write the tensors themselves.)"""
    return tuple((t.data_ptr(), t._version) for m in modules for t in (m.weight, m.bias) if t is not None)


class _Matmul:
    """x ↦ x Wᵀ + b for the weights of `modules` stacked along the output dimension (one GEMM for several
    projections of the same input): oneDNN-packed (`packed`) or dense for `F.linear`. A copy, taken
    when built: `FastDecoder` rebuilds it when a source weight changes."""

    def __init__(self, modules, packed: bool) -> None:
        with torch.no_grad():
            weight = torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
            biases = [m.bias for m in modules]
            bias = None if biases[0] is None else torch.cat(biases).detach()
        self.packed = packed
        self.weight = packed_weight(weight, _PACK_ROWS) if packed else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class _LayerWeights:
    """A decoder layer's projections as four `_Matmul`s: q|k|v fused, o, gate|up fused, down."""

    def __init__(self, parts, packed: bool) -> None:
        q, k, v, gate, up, o, down = parts
        self.qkv, self.gate_up = _Matmul([q, k, v], packed), _Matmul([gate, up], packed)
        self.o, self.down = _Matmul([o], packed), _Matmul([down], packed)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
