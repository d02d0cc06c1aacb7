"""Build a tiny random-init model + locally trained tokenizer, saved as a plain HF folder.

`AutoTokenizer` / `AutoModelForCausalLM` (head="lm") or `AutoModelForSequenceClassification`
(head="score", one label: a reward model or critic) load the result like any hub model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
)

from posttrain.models.saving import atomic_output_dir
from posttrain.models.tiny_tokenizer import IM_END, PAD_TOKEN, train_tiny_tokenizer
from posttrain.utils.log import info


@dataclass(frozen=True)
class TinyPreset:
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
_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification),
}
_HEADS = ("lm", "score")
MAX_POSITION_EMBEDDINGS = 4096


def build_tiny(output_dir, arch: str = "llama", size: str = "tiny", head: str = "lm", seed: int = 0,
               vocab_size: int | None = None, overwrite: bool = False, verbose: bool = True) -> dict:
    """Write tokenizer + random-init model (`seed` → identical weights) into `output_dir`.

    The tokenizer does not depend on `seed` (all tiny models share one vocabulary); the model's
    vocabulary is exactly `len(tokenizer)`. Embeddings are tied for head="lm". The folder is
    written to a temporary sibling and renamed into place. Returns a summary dict:
    {"path", "arch", "size", "head", "seed", "num_parameters", "vocab_size", "pad_token_id",
    "eos_token_id"}.
    """
    if arch not in _ARCHS:
        raise ValueError(f"arch={arch!r}: valid values are {sorted(_ARCHS)}")
    if size not in PRESETS:
        raise ValueError(f"size={size!r}: valid values are {list(PRESETS)}")
    if head not in _HEADS:
        raise ValueError(f"head={head!r}: valid values are {list(_HEADS)}")
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output_dir {out} exists and is not empty; choose another directory "
                              "or pass overwrite=True (--overwrite)")

    tokenizer = train_tiny_tokenizer(vocab_size or 2048, model_max_length=MAX_POSITION_EMBEDDINGS)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_END])
    p = PRESETS[size]
    config_cls, lm_cls, score_cls = _ARCHS[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=(head == "lm"),
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        num_labels=1,
    )
    torch.manual_seed(seed)
    model = (lm_cls if head == "lm" else score_cls)(config).float().eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                                               bos_token_id=None)
    n_params = sum(t.numel() for t in model.parameters())  # tied weights are counted once

    with atomic_output_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_class(tmp)
    summary = {"path": str(out), "arch": arch, "size": size, "head": head, "seed": seed,
               "num_parameters": n_params, "vocab_size": len(tokenizer),
               "pad_token_id": pad_id, "eos_token_id": eos_id}
    if verbose:
        info(f"built tiny {arch}/{size} ({head} head): {n_params:,} parameters, "
             f"vocab {len(tokenizer)}, seed {seed} -> {out}")
    return summary


def _portable_tokenizer_class(folder: Path) -> None:
    """Name the class `PreTrainedTokenizerFast` and list `<|im_start|>` under
    `additional_special_tokens`: spellings that transformers 4.x and 5.x both read."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if extra:
        cfg["additional_special_tokens"] = list(extra)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
