"""Build a tiny random-init model + locally trained tokenizer, saved as a plain HF folder; or, with
a shape (`shapes.py`), a random-init model with the dimensions of a released one.

`AutoTokenizer` / `AutoModelForCausalLM` (head="lm") or `AutoModelForSequenceClassification`
(head="score", one label: a reward model or critic) load the result like any hub model.
"""
from __future__ import annotations

from contextlib import contextmanager
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
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3MoeForSequenceClassification,
)

from posttrain.models.saving import atomic_output_dir
from posttrain.models.shapes import PRESETS, SHAPES, ModelShape
from posttrain.models.tiny_tokenizer import IM_END, PAD_TOKEN, portable_tokenizer_class, train_tiny_tokenizer
from posttrain.utils.log import info

_ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification),
    # a mixture of experts: a preset's attention, 4 experts of half its MLP width, 2 per token (the dense
    # preset's active MLP size)
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeForSequenceClassification),
}
MOE_EXPERTS, MOE_PER_TOKEN = 4, 2
_HEADS = ("lm", "score")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_POSITION_EMBEDDINGS = 4096


def build_tiny(output_dir, arch: str | None = None, size: str | None = None, head: str = "lm", seed: int = 0,
               vocab_size: int | None = None, overwrite: bool = False, verbose: bool = True,
               shape: str | ModelShape | None = None, dtype: str = "fp32", vision: bool = False) -> dict:
    """Write tokenizer + random-init model (`seed` → identical weights) into `output_dir`.

    `size` (a PRESETS name, default "tiny", `arch` default "llama") or `shape` (a SHAPES name or a
    ModelShape: a real model's dimensions, its own arch and vocabulary). The tokenizer does not depend
    on `seed` (all tiny models share one vocabulary); a preset's vocabulary is exactly `len(tokenizer)`,
    a shape's is its own (larger: the rows past the tokenizer are never fed). Embeddings are tied for
    head="lm". `dtype`: "fp32" or "bf16" (initialised and saved in that dtype). The folder is written to
    a temporary sibling and renamed into place. `vision`: a tiny Qwen2.5-VL instead (`tiny_vision.py`: the
    preset's language model with a small vision tower and an image processor; head "lm", fp32). Returns a
    summary dict: {"path", "arch", "size", "shape", "head", "seed", "dtype", "num_parameters",
    "vocab_size", "pad_token_id", "eos_token_id"}.
    """
    if isinstance(shape, str) and shape not in SHAPES:
        raise ValueError(f"shape={shape!r}: valid values are {list(SHAPES)}")
    if shape is not None and size is not None:
        raise ValueError("give size (a tiny preset) or shape (a real model's dimensions), not both")
    spec = SHAPES[shape] if isinstance(shape, str) else shape
    if spec is not None and arch is not None and arch != spec.arch:
        raise ValueError(f"arch={arch!r}: shape {shape!r} is a {spec.arch} model")
    arch = spec.arch if spec is not None else (arch or "llama")
    size = None if spec is not None else (size or "tiny")
    if arch not in _ARCHS:
        raise ValueError(f"arch={arch!r}: valid values are {sorted(_ARCHS)}")
    if size is not None and size not in PRESETS:
        raise ValueError(f"size={size!r}: valid values are {list(PRESETS)}")
    if head not in _HEADS:
        raise ValueError(f"head={head!r}: valid values are {list(_HEADS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: valid values are {list(_DTYPES)}")
    if vision and (spec is not None or head != "lm" or dtype != "fp32" or arch != "llama" or vocab_size):
        raise ValueError("vision builds a tiny Qwen2.5-VL from a size preset: give --size only (no --shape, "
                         "--arch, --head score, --dtype bf16)")
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"output_dir {out} exists and is not empty; choose another directory "
                              "or pass overwrite=True (--overwrite)")
    if vision:
        return _build_vision(out, size, seed, verbose)

    max_len = spec.max_position_embeddings if spec is not None else MAX_POSITION_EMBEDDINGS
    tokenizer = train_tiny_tokenizer(vocab_size or 2048, model_max_length=max_len)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_END])
    if spec is None:
        p = PRESETS[size]
        moe = dict(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_PER_TOKEN,
                   moe_intermediate_size=p.intermediate_size // MOE_PER_TOKEN) if arch == "qwen3_moe" else {}
        spec = ModelShape(arch, p.hidden_size, p.num_hidden_layers, p.num_attention_heads,
                          p.num_key_value_heads, p.intermediate_size, len(tokenizer),
                          max_position_embeddings=MAX_POSITION_EMBEDDINGS, **moe)
    config = model_config(spec, head, pad_id, eos_id)
    torch.manual_seed(seed)
    cls = _ARCHS[arch][1 if head == "lm" else 2]
    with _default_dtype(_DTYPES[dtype]):
        model = cls(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id,
                                               bos_token_id=None)
    n_params = sum(t.numel() for t in model.parameters())  # tied weights are counted once

    with atomic_output_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        portable_tokenizer_class(tmp)
    name = shape if isinstance(shape, str) else ("custom" if shape is not None else None)
    summary = {"path": str(out), "arch": arch, "size": size, "shape": name, "head": head, "seed": seed,
               "dtype": dtype, "num_parameters": n_params, "vocab_size": spec.vocab_size,
               "pad_token_id": pad_id, "eos_token_id": eos_id}
    if verbose:
        info(f"built {name or 'tiny ' + size} {arch} ({head} head, {dtype}): {n_params:,} parameters, "
             f"vocab {spec.vocab_size} (tokenizer {len(tokenizer)}), seed {seed} -> {out}")
    return summary


def _build_vision(out: Path, size: str, seed: int, verbose: bool) -> dict:
    from posttrain.models.tiny_vision import build_tiny_vision

    n_params, vocab, pad_id, eos_id = build_tiny_vision(out, PRESETS[size], seed, MAX_POSITION_EMBEDDINGS)
    if verbose:
        info(f"built tiny {size} qwen2_5_vl (vision-language, fp32): {n_params:,} parameters, vocab {vocab}, "
             f"seed {seed} -> {out}")
    return {"path": str(out), "arch": "qwen2_5_vl", "size": size, "shape": None, "head": "lm", "seed": seed,
            "dtype": "fp32", "num_parameters": n_params, "vocab_size": vocab, "pad_token_id": pad_id,
            "eos_token_id": eos_id, "vision": True}


def model_config(shape: ModelShape, head: str = "lm", pad_token_id: int | None = None,
                 eos_token_id: int | None = None):
    """The HF config of `shape` (no weights): tied embeddings for head="lm", one label for "score"."""
    return _ARCHS[shape.arch][0](
        **shape.config_kwargs(), initializer_range=0.02, tie_word_embeddings=(head == "lm"),
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id, num_labels=1)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Create parameters directly in `dtype` (a bf16 model never exists in fp32 first)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
