"""The dimensions of common released models (`posttrain init-tiny --shape`): random-init models of the
exact size of Qwen2.5 0.5B / 1.5B and Llama-3.2 1B, to measure memory and speed at realistic sizes
without a download. The numbers are those of each model's published `config.json`. Also the tiny presets
(`--size`). No torch or transformers here: `init-tiny` checks its flags against these before they load."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """An architecture's dimensions; `config_kwargs()`: the fields of its HF config."""
    arch: str  # "llama" | "qwen2" | "qwen3_moe"
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float | None = None  # None: the config class's default
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    num_experts: int = 0  # a mixture of experts (qwen3_moe): experts per layer, each of moe_intermediate_size
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def config_kwargs(self) -> dict:
        kwargs = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                      intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
                      num_attention_heads=self.num_attention_heads,
                      num_key_value_heads=self.num_key_value_heads, rms_norm_eps=self.rms_norm_eps,
                      max_position_embeddings=self.max_position_embeddings)
        if self.num_experts:
            kwargs.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                          moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=1,
                          head_dim=self.hidden_size // self.num_attention_heads)
        if self.rope_theta is not None:
            kwargs["rope_theta"] = self.rope_theta
        if self.rope_scaling is not None:
            kwargs["rope_scaling"] = dict(self.rope_scaling)
        return kwargs


# Parameter counts (tied embeddings): 494,032,768 / 1,543,714,304 / 1,235,814,400.
SHAPES: dict[str, ModelShape] = {
    "qwen2.5-0.5b": ModelShape("qwen2", 896, 24, 14, 2, 4864, 151936, rope_theta=1e6,
                               max_position_embeddings=32768),
    "qwen2.5-1.5b": ModelShape("qwen2", 1536, 28, 12, 2, 8960, 151936, rope_theta=1e6,
                               max_position_embeddings=131072),
    "llama3.2-1b": ModelShape("llama", 2048, 16, 32, 8, 8192, 128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                              max_position_embeddings=131072,
                              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192}),
}


@dataclass(frozen=True)
class TinyPreset:
    """A tiny model's dimensions (`posttrain init-tiny --size`)."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


# Parameter counts with the default ~2k vocabulary and tied embeddings (llama; qwen2 adds q/k/v biases).
PRESETS: dict[str, TinyPreset] = {
    "nano": TinyPreset(128, 4, 4, 2, 352),     # ~1.0M
    "tiny": TinyPreset(192, 6, 6, 2, 512),     # ~2.7M
    "small": TinyPreset(384, 6, 6, 2, 1024),   # ~10M
    "base": TinyPreset(512, 10, 8, 2, 1408),   # ~29M
}
