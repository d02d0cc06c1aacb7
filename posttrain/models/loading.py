"""Load tokenizers, causal LMs and score (reward / critic) models from a local folder or hub id."""
from __future__ import annotations

import glob
import os

import torch

from posttrain.models.lora import apply_lora, as_lora_spec
from posttrain.utils.log import info, warn_once

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
INIT_TINY_HINT = "build one with `posttrain init-tiny --output DIR`"


def parse_dtype(dtype) -> torch.dtype:
    """"fp32" | "bf16" | "fp16" (or the long names, or a torch.dtype) → torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: valid values are fp32, bf16, fp16")
    return _DTYPES[dtype]


def check_model_path(path) -> str:
    """Return `path` (user-expanded) if it is a local folder or looks like a hub id ("org/name"
    whose "org" is not a local folder); otherwise raise FileNotFoundError with the init-tiny hint."""
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        return p
    parts = p.split("/")
    hub_like = (len(parts) == 2 and all(parts) and not p.startswith((".", "~"))
                and not os.path.isdir(parts[0]))
    if not hub_like:
        raise FileNotFoundError(f"model path {str(path)!r} not found; {INIT_TINY_HINT}")
    return p


def _hub_error(path: str, err: Exception) -> FileNotFoundError:
    return FileNotFoundError(f"model path {path!r} not found locally and could not be loaded from the hub "
                             f"({type(err).__name__}: {err}); {INIT_TINY_HINT} (HF_HUB_OFFLINE=1 skips the hub retries)")


def load_tokenizer(path, use_fast: bool = True, chat_template: str | None = None):
    """AutoTokenizer with `padding_side="right"` and a pad token (the eos token when the
    checkpoint has none, with a note). `chat_template` replaces the checkpoint's template:
    either Jinja text or the path of a file holding it."""
    from transformers import AutoTokenizer

    p = check_model_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(p, use_fast=use_fast)
    except OSError as err:
        if os.path.isdir(p):
            raise
        raise _hub_error(p, err) from err
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {p} has neither a pad nor an eos token; add one to its "
                             "tokenizer_config.json")
        tok.pad_token = tok.eos_token
        info(f"tokenizer {p} has no pad token; using eos {tok.eos_token!r} as pad")
    tok.padding_side = "right"
    if chat_template is not None:
        if os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        tok.chat_template = chat_template
    return tok


def quantization_4bit(dtype):
    """QLoRA's 4-bit NF4 weights (double quantisation, compute in `dtype`) via bitsandbytes, which
    needs a CUDA GPU; raises ValueError saying why when it cannot work here."""
    if not torch.cuda.is_available():
        raise ValueError("--ds.load_in_4bit: bitsandbytes 4-bit loading needs a CUDA GPU and none is visible; "
                         "drop the flag (LoRA alone works on CPU)")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ValueError("--ds.load_in_4bit needs bitsandbytes: pip install 'posttrain[qlora]'") from err
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=parse_dtype(dtype))


def _from_pretrained(cls, path, dtype, attn_implementation, load_in_4bit=False, **kwargs):
    """`cls.from_pretrained` with the requested attention backend; when none was requested,
    sdpa, falling back to eager (with a note) for architectures without sdpa support."""
    p = check_model_path(path)
    if load_in_4bit:
        kwargs["quantization_config"] = quantization_4bit(dtype)
    attn = attn_implementation or "sdpa"
    try:
        try:
            return cls.from_pretrained(p, dtype=parse_dtype(dtype), attn_implementation=attn, **kwargs)
        except (ValueError, ImportError) as err:
            if attn_implementation is not None or "sdpa" not in str(err).lower():
                raise
            warn_once(f"{p}: sdpa attention is not available ({err}); using eager")
            return cls.from_pretrained(p, dtype=parse_dtype(dtype), attn_implementation="eager", **kwargs)
    except OSError as err:
        if os.path.isdir(p):
            raise
        raise _hub_error(p, err) from err


def _finish(model, lora, task_type, gradient_checkpointing, reentrant, load_in_4bit=False):
    if load_in_4bit:
        if as_lora_spec(lora) is None:
            raise ValueError("--ds.load_in_4bit: 4-bit weights cannot be trained; add LoRA (--ds.lora.rank > 0)")
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    if gradient_checkpointing:
        kwargs = {"use_reentrant": reentrant}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.config.use_cache = False
    model = apply_lora(model, lora, task_type=task_type)
    if gradient_checkpointing and hasattr(model, "peft_config"):
        # frozen embeddings give checkpointed blocks inputs without grad; reentrant checkpointing
        # would then drop the adapters' gradients
        model.enable_input_require_grads()
    return model


def load_causal_lm(path, dtype="fp32", attn_implementation: str | None = None, lora=None,
                   gradient_checkpointing: bool = False, gradient_checkpointing_reentrant: bool = False,
                   load_in_4bit: bool = False):
    """AutoModelForCausalLM from `path` in `dtype` ("fp32"/"bf16"/"fp16").

    attn_implementation: None → "sdpa" (eager where unsupported), or "eager",
    "flash_attention_2", ... `lora`: None, a LoraSpec, dict or `cfg.ds.lora`-like object
    (rank 0 = off) → peft model with only adapters trainable; `load_in_4bit` (CUDA + bitsandbytes,
    with LoRA) loads the base in 4-bit NF4 (QLoRA). Returned in eval mode (call `.train()` to
    enable dropout)."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, path, dtype, attn_implementation, load_in_4bit)
    return _finish(model, lora, "CAUSAL_LM", gradient_checkpointing, gradient_checkpointing_reentrant,
                   load_in_4bit)


def load_score_model(path, dtype="fp32", value_head_prefix: str = "score", attn_implementation: str | None = None,
                     lora=None, gradient_checkpointing: bool = False,
                     gradient_checkpointing_reentrant: bool = False, load_in_4bit: bool = False):
    """AutoModelForSequenceClassification (num_labels=1: one scalar per token, a reward model or
    critic). The head is `model.score`; a checkpoint that stores it as `{value_head_prefix}.weight`
    / `.bias` (e.g. "value_head") is mapped onto it. A causal-LM checkpoint gets a freshly
    initialised head (from the global torch RNG), with a note."""
    from transformers import AutoModelForSequenceClassification

    model = _from_pretrained(AutoModelForSequenceClassification, path, dtype, attn_implementation, load_in_4bit,
                             num_labels=1)
    head = read_head(check_model_path(path), value_head_prefix)
    if head:
        with torch.no_grad():
            for name, tensor in head.items():
                target = getattr(model.score, name, None)
                if target is None or target.shape != tensor.shape:
                    raise ValueError(f"--ds.value_head_prefix={value_head_prefix!r}: checkpoint tensor "
                                     f"{value_head_prefix}.{name} {tuple(tensor.shape)} does not fit the score "
                                     f"head {None if target is None else tuple(target.shape)}")
                target.copy_(tensor.to(target.dtype))
    elif value_head_prefix != "score":
        raise ValueError(f"--ds.value_head_prefix={value_head_prefix!r}: no tensor "
                         f"{value_head_prefix}.weight in the checkpoint {path}")
    else:
        info(f"{path} has no score head; initialised a new one")
    return _finish(model, lora, "SEQ_CLS", gradient_checkpointing, gradient_checkpointing_reentrant,
                   load_in_4bit)


def read_head(folder: str, prefix: str) -> dict[str, torch.Tensor]:
    """Tensors `{prefix}.weight` / `{prefix}.bias` from the folder's safetensors files (local only)."""
    from safetensors import safe_open

    found = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for name in ("weight", "bias"):
                if f"{prefix}.{name}" in keys:
                    found[name] = f.get_tensor(f"{prefix}.{name}")
    return found
