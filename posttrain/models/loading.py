"""Load tokenizers, causal LMs and score (reward / critic) models from a local folder or hub id.

Before a model trains, its checkpoint is checked for the role it is given (a `ModelLoadError`
naming the folder, the cause and the fix): a local folder must hold config.json and weights, not
only tokenizer files; a causal LM must not be a reward/score model (its LM head would start
random); a score model must carry a trained head unless the caller starts a new one
(`new_head_ok`: the PPO critic, `posttrain rm`); and the tokenizer may not have more tokens than
the model has embedding rows."""
from __future__ import annotations

import contextlib
import glob
import json
import os
from typing import TYPE_CHECKING

import torch

from posttrain.models.cpu_linear import use_onednn_linears
from posttrain.models.folders import (
    _TOKENIZER_FILES,
    INIT_TINY_HINT,
    ModelLoadError,
    _checked_folder,
    check_model_path,
)
from posttrain.models.lora import apply_lora, as_lora_spec
from posttrain.models.shard_loading import (
    fill_shards,
    init_missing,
    quiet_transformers,
    renamed_to_module,
    safetensors_keys,
    without_random_init,
    zero3_loading,
)
from posttrain.utils.extras import require
from posttrain.utils.log import info, warn_once

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
# names of scalar heads that reward / value models store (HF score, OpenRLHF value_head, TRL v_head)
_HEAD_NAMES = ("score", "value_head", "v_head", "v_head.summary", "reward_head")


def parse_dtype(dtype) -> torch.dtype:
    """"fp32" | "bf16" | "fp16" (or the long names, or a torch.dtype) → torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: valid values are fp32, bf16, fp16")
    return _DTYPES[dtype]


def _hub_error(path: str, err: Exception) -> FileNotFoundError:
    """One line: the hub's own message keeps only its first line (transformers adds a second of advice)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return FileNotFoundError(f"model path {path!r} not found locally and could not be loaded from the hub "
                             f"({type(err).__name__}: {first}); {INIT_TINY_HINT} (HF_HUB_OFFLINE=1 skips the "
                             "hub retries)")


def load_tokenizer(path, use_fast: bool = True, chat_template: str | None = None):
    """AutoTokenizer with `padding_side="right"` and a pad token (the eos token when the
    checkpoint has none, with a note). `chat_template` replaces the checkpoint's template:
    either Jinja text or the path of a file holding it. Without it, a vision-language model's tokenizer
    takes its processor's chat template (`_processor_template`)."""
    from transformers import AutoTokenizer

    p = check_model_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(p, use_fast=use_fast)
    except Exception as err:  # noqa: BLE001  (tokenizers raises bare Exceptions for a garbled file)
        if not os.path.isdir(p):
            if isinstance(err, OSError):
                raise _hub_error(p, err) from err
            raise
        raise _tokenizer_error(p, err) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(f"tokenizer at {p} has neither a pad nor an eos token; add one to its "
                                 "tokenizer_config.json")
        tok.pad_token = tok.eos_token
        info(f"tokenizer {p} has no pad token; using eos {tok.eos_token!r} as pad")
    tok.padding_side = "right"
    if chat_template is not None:
        if os.path.isfile(chat_template):
            with open(chat_template) as f:
                chat_template = f.read()
        tok.chat_template = chat_template
    else:
        _processor_template(tok, p)
    return tok


def _processor_template(tok, path) -> None:
    """A VLM renders with its processor's chat template, as OpenRLHF does (it renders with the processor):
    where the folder's processor template differs from the tokenizer's, the tokenizer takes it (a note)."""
    from posttrain.models.vision import is_vision_folder, processor_chat_template

    own = processor_chat_template(path) if is_vision_folder(path) else None
    if own is not None and own != tok.chat_template:
        info(f"{path}: the processor's chat template differs from the tokenizer's; prompts are rendered with "
             "the processor's, as OpenRLHF renders them (--data.tokenizer_chat_template replaces both)")
        tok.chat_template = own


def _tokenizer_error(folder: str, err: Exception) -> ModelLoadError:
    """The tokenizer files of `folder` that do not load: which one, and the fix."""
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        what = "has no tokenizer.json (and no other tokenizer files that load)"
    else:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        what = f"has a tokenizer.json that cannot be read ({type(err).__name__}: {first})"
    return ModelLoadError(f"model folder {folder} {what}; copy the tokenizer files (tokenizer.json, "
                          "tokenizer_config.json) of the model it was trained from into it")


def quantization_4bit(dtype):
    """QLoRA's 4-bit NF4 weights (double quantisation, compute in `dtype`) via bitsandbytes, which
    needs a CUDA GPU; raises ValueError saying why when it cannot work here."""
    if not torch.cuda.is_available():
        raise ValueError("--ds.load_in_4bit: bitsandbytes 4-bit loading needs a CUDA GPU and none is "
                         "visible; drop the flag (LoRA alone works on CPU)")
    require("--ds.load_in_4bit", "bitsandbytes")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=parse_dtype(dtype))


def _from_pretrained(cls, path, dtype, attn_implementation, load_in_4bit=False, **kwargs):
    """(model, loading info) from `cls.from_pretrained` with the requested attention backend; when none
    was requested, sdpa, falling back to eager (with a note) for architectures without sdpa support.
    The loading info lists the `missing_keys`: parameters the checkpoint lacks, initialised at random."""
    p = check_model_path(path)
    if load_in_4bit:
        kwargs["quantization_config"] = quantization_4bit(dtype)
    kwargs["output_loading_info"] = True
    where = safetensors_keys(p) if not load_in_4bit and os.path.isdir(p) and zero3_loading() else {}
    if where:  # ZeRO-3: each rank reads only its own slices (models/shard_loading.py)
        rng = torch.random.get_rng_state()
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(p, **{k: v for k, v in kwargs.items() if k == "num_labels"})
        # built under zero.Init from its config alone (nothing read; its random init drawn from a forked RNG)
        with quiet_transformers(), torch.random.fork_rng():
            model = _from_config(_model_class(cls, config), config, p, dtype, attn_implementation)
        try:
            missing = fill_shards(model, renamed_to_module(model, where))
        except ValueError as err:  # a tensor of another shape than the config's, or a truncated file
            raise ModelLoadError(f"{err}: the model folder {p} is damaged or its config.json does not match "
                                 "its weights; save or download the model again") from None
        if set(missing) <= _NEW_HEAD_KEYS:
            init_missing(model, missing, rng)  # from the RNG state an unsharded load starts with
            return model, {"missing_keys": set(missing)}
        info(f"{p}: its tensor names differ from the model's ({', '.join(sorted(missing)[:3])}, ...); "
             "loading through transformers (rank 0 reads the whole checkpoint)")
        del model
        torch.random.set_rng_state(rng)
    return _from_pretrained_attn(cls, p, dtype, attn_implementation, **kwargs)


def _from_config(model_cls, config, path: str, dtype, attn_implementation):
    """`model_cls` built from `config` (under a live HfDeepSpeedConfig: as ZeRO-3 shards, initialised one
    module at a time), in eval mode with the folder's generation config, as `from_pretrained` returns it."""
    from transformers import GenerationConfig

    def build(attn):
        with without_random_init():
            return model_cls._from_config(config, dtype=parse_dtype(dtype), attn_implementation=attn)

    try:
        model = build(attn_implementation or "sdpa")
    except (ValueError, ImportError) as err:
        if attn_implementation is not None or "sdpa" not in str(err).lower():
            raise
        warn_once(f"{path}: sdpa attention is not available ({err}); using eager")
        model = build("eager")
    if model.can_generate() and os.path.isfile(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _model_class(auto_cls, config):
    """The concrete class an Auto class picks for `config`."""
    from transformers.models.auto.auto_factory import _get_model_class

    return _get_model_class(config, auto_cls._model_mapping)


_NEW_HEAD_KEYS = {"score.weight", "score.bias"}  # a score model started from a causal LM gets a new head


def hub_kernels_requested() -> bool:
    """Whether layers may be swapped for kernels downloaded from the Hub (transformers' `use_kernels`). Recent
    transformers turn that on by default whenever the `kernels` package is installed (it is one of its
    requirements), so on a GPU loading would fetch and run remote code, and fail offline; posttrain loads
    without them unless the user sets `USE_HUB_KERNELS` (1 / yes / true / on)."""
    return os.environ.get("USE_HUB_KERNELS", "").strip().lower() in ("1", "yes", "true", "on")


def _from_pretrained_attn(cls, p, dtype, attn_implementation, **kwargs):
    attn = attn_implementation or "sdpa"
    kwargs["use_kernels"] = hub_kernels_requested()
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
    except RuntimeError as err:
        if "mismatched_sizes" not in str(err) and "size mismatch" not in str(err):
            raise
        raise ModelLoadError(f"model {p}: its weights do not have the shapes its config.json gives (the "
                             "report above names the tensors); the folder is damaged or config.json was "
                             "edited: save or download the model again") from None


def set_experts(model, experts_implementation: str | None, path) -> None:
    """--ds.experts_implementation: the MoE expert kernels (eager, batched_mm, grouped_mm, deepgemm); None
    leaves transformers' choice. ModelLoadError when the model has no experts or cannot run that kernel
    here."""
    if experts_implementation is None:
        return
    from posttrain.models.moe import is_moe

    if not is_moe(model):
        raise ModelLoadError(f"--ds.experts_implementation {experts_implementation}: model {path} is not a "
                             "mixture of experts; drop the flag")
    try:
        model.set_experts_implementation(experts_implementation)
    except (ValueError, ImportError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelLoadError(f"--ds.experts_implementation {experts_implementation}: {first}") from None


def _finish(model, lora, task_type, gradient_checkpointing, reentrant, load_in_4bit=False,
            onednn_linear=True):
    if load_in_4bit:
        if as_lora_spec(lora) is None:
            raise ValueError("--ds.load_in_4bit: 4-bit weights cannot be trained; add LoRA "
                             "(--ds.lora.rank > 0)")
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
    if onednn_linear:
        use_onednn_linears(model)
    return model


def load_causal_lm(path, dtype="fp32", attn_implementation: str | None = None, lora=None,
                   gradient_checkpointing: bool = False, gradient_checkpointing_reentrant: bool = False,
                   load_in_4bit: bool = False, tokenizer=None, onednn_linear: bool = True,
                   experts_implementation: str | None = None):
    """AutoModelForCausalLM from `path` in `dtype` ("fp32"/"bf16"/"fp16"); AutoModelForImageTextToText when
    the folder's config has a vision part (a vision-language model, `models/vision.py`).

    attn_implementation: None → "sdpa" (eager where unsupported), or "eager",
    "flash_attention_2", ... `lora`: None, a LoraSpec, dict or `cfg.ds.lora`-like object
    (rank 0 = off) → peft model with only adapters trainable; `load_in_4bit` (CUDA + bitsandbytes,
    with LoRA) loads the base in 4-bit NF4 (QLoRA). `onednn_linear`: its plain linear layers compute
    fp32 on CPU through oneDNN (`cpu_linear`; --ds.no_onednn_linear passes False).
    `experts_implementation`: a mixture of experts' expert kernels (`set_experts`). Returned in eval mode
    (call `.train()` to enable dropout).

    Raises ModelLoadError when a local folder has no config.json or no weights; when the checkpoint
    is a reward/score model (a sequence-classification architecture, a score/value head without an
    LM head, or an LM head the checkpoint lacks); and when `tokenizer` (default: the folder's own,
    if it has one) has more tokens than the model's input embedding has rows."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from posttrain.models.vision import is_vision_folder

    folder = _checked_folder(path)
    if folder is not None:
        _refuse_score_checkpoint(folder)
    vision = folder is not None and is_vision_folder(folder)  # a VLM loads whole: vision tower and LM
    model, loading = _from_pretrained(AutoModelForImageTextToText if vision else AutoModelForCausalLM, path,
                                      dtype, attn_implementation, load_in_4bit)
    if "lm_head.weight" in loading.get("missing_keys", ()):
        raise ModelLoadError(f"model {path}: its checkpoint has no LM head (lm_head.weight), so it is not a "
                             f"causal language model (architecture {_arch_text(model.config)}) and its LM "
                             f"head would be initialised at random; {_CAUSAL_LM_FIX}")
    check_vocab(model, tokenizer if tokenizer is not None else _own_tokenizer(folder), path)
    set_experts(model, experts_implementation, path)
    return _finish(model, lora, "CAUSAL_LM", gradient_checkpointing, gradient_checkpointing_reentrant,
                   load_in_4bit, onednn_linear)


def load_score_model(path, dtype="fp32", value_head_prefix: str = "score",
                     attn_implementation: str | None = None, lora=None, gradient_checkpointing: bool = False,
                     gradient_checkpointing_reentrant: bool = False, load_in_4bit: bool = False,
                     new_head_ok: bool = False, tokenizer=None, onednn_linear: bool = True,
                     experts_implementation: str | None = None):
    """AutoModelForSequenceClassification (num_labels=1: one scalar per token, a reward model or
    critic). The head is `model.score`; a checkpoint that stores it as `{value_head_prefix}.weight`
    / `.bias` (e.g. "value_head") is mapped onto it.

    A checkpoint without a trained head (a causal LM) is refused with a ModelLoadError unless
    `new_head_ok`: then it gets a freshly initialised head (from the global torch RNG), with a note.
    Only callers that train the head from scratch pass True (the PPO critic, `posttrain rm` starting
    from an SFT model); a reward model with a random head would make PPO train on noise. Also raises
    ModelLoadError for a local folder without config.json or weights and for a tokenizer (default:
    the folder's own, if it has one) with more tokens than the model has embedding rows.
    `onednn_linear` and `experts_implementation` as for `load_causal_lm`. With `lora` the head trains fully
    (peft's SEQ_CLS task keeps it as a module to save: saved with the adapter), said in one line."""
    from transformers import AutoModelForSequenceClassification

    folder = _checked_folder(path)
    if load_in_4bit:
        quantization_4bit(dtype)  # an environment that cannot load 4-bit weights is named first
    keys = _weight_keys(folder) if folder is not None else None
    if value_head_prefix != "score" and f"{value_head_prefix}.weight" not in (keys or ()):
        raise ModelLoadError(f"--ds.value_head_prefix={value_head_prefix!r}: no tensor "
                             f"{value_head_prefix}.weight in the checkpoint {path}")
    if not new_head_ok and keys is not None and f"{value_head_prefix}.weight" not in keys:
        raise _no_head_error(path, value_head_prefix, _read_config(folder).get("architectures"), keys)
    model, loading = _from_pretrained(AutoModelForSequenceClassification, path, dtype, attn_implementation,
                                      load_in_4bit, num_labels=1)
    head = read_head(folder, value_head_prefix) if folder is not None and value_head_prefix != "score" else {}
    if head:
        copy_head(model.score, head, value_head_prefix)
    elif "score.weight" in loading.get("missing_keys", ()):
        if not new_head_ok:
            raise _no_head_error(path, value_head_prefix, model.config.architectures)
        info(f"{path} has no score head; initialised a new one")
    check_vocab(model, tokenizer if tokenizer is not None else _own_tokenizer(folder), path)
    set_experts(model, experts_implementation, path)
    if as_lora_spec(lora) is not None:
        info("LoRA on a score model: its head (score) trains fully (no adapter on it) and is saved with the "
             "adapter; OpenRLHF 0.10.2 freezes the head and adapts it")
    return _finish(model, lora, "SEQ_CLS", gradient_checkpointing, gradient_checkpointing_reentrant,
                   load_in_4bit, onednn_linear)


def _full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole tensor: a ZeRO-3 partition (`ds_id`) is empty until gathered."""
    return param.ds_shape if hasattr(param, "ds_id") else param.shape


@contextlib.contextmanager
def _writable(params: list[torch.Tensor]):
    """Inside, `params` hold their whole values: ZeRO-3 partitions (`ds_id`, a model loaded under
    `deepspeed.zero.Init`) are gathered, and what rank 0 writes into them is scattered back to every
    rank's shard on exit; plain tensors are left as they are."""
    sharded = [p for p in params if hasattr(p, "ds_id")]
    if not sharded:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(sharded, modifier_rank=0):
        yield


def copy_head(head: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Copy checkpoint tensors `{prefix}.weight` / `.bias` (`tensors`: name -> tensor) into the score
    head `head`, also when the head is held as ZeRO-3 shards; ModelLoadError when one does not fit."""
    targets = {}
    for name, tensor in tensors.items():
        target = getattr(head, name, None)
        if target is None or _full_shape(target) != tensor.shape:
            raise ModelLoadError(f"--ds.value_head_prefix={prefix!r}: checkpoint tensor {prefix}.{name} "
                                 f"{tuple(tensor.shape)} does not fit the score head "
                                 f"{None if target is None else tuple(_full_shape(target))}")
        targets[name] = target
    with torch.no_grad(), _writable(list(targets.values())):
        for name, target in targets.items():
            target.copy_(tensors[name].to(target.dtype))


_CAUSAL_LM_FIX = ("give a causal LM here (a base or SFT model); a trained reward model belongs in "
                  "--reward.model_name_or_path")


def _no_head_error(path, prefix: str, architectures, keys=None) -> ModelLoadError:
    arch = f"; architecture {architectures[0]}" if architectures else ""
    other = sorted(k[: -len(".weight")] for k in keys or () if k.endswith(".weight")
                   and k[: -len(".weight")] in _HEAD_NAMES)
    fix = (f"its weights hold {other[0]}.weight: pass --ds.value_head_prefix {other[0]}" if other else
           "give a reward model trained with `posttrain rm` (or OpenRLHF's train_rm); if its head is "
           "stored under another name, set --ds.value_head_prefix to it")
    return ModelLoadError(
        f"model {path} has no trained score head (no {prefix}.weight in its weights{arch}), so it is not a "
        f"reward model: a new head would score at random and PPO would train on noise; {fix}")


def _read_config(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _arch_text(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else type(config).__name__


def _is_score_architecture(name: str) -> bool:
    return name.endswith(("ForSequenceClassification", "ForTokenClassification")) or "RewardModel" in name \
        or name == "CriticModel"


def _weight_keys(folder: str) -> set[str] | None:
    """Tensor names of the folder's safetensors files (headers only); None without safetensors files."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        return None
    keys: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt") as f:
            keys.update(f.keys())
    return keys


def _refuse_score_checkpoint(folder: str) -> None:
    """ModelLoadError when a local folder holds a reward/score model: its config names a
    sequence-classification (or reward/critic) architecture, or its weights carry a score / value head
    and no LM head (with untied embeddings, so the LM head would start random)."""
    config = _read_config(folder)
    archs = [a for a in config.get("architectures") or [] if _is_score_architecture(a)]
    keys = _weight_keys(folder) or set()
    heads = sorted(k for k in keys if k.endswith(".weight") and k[: -len(".weight")] in _HEAD_NAMES)
    untied = not config.get("tie_word_embeddings", False)
    if archs:
        why = f"architecture {archs[0]}"
    elif heads and "lm_head.weight" not in keys and untied:
        why = f"its weights hold {heads[0]} and no lm_head.weight"
    else:
        return
    raise ModelLoadError(f"model {folder} is a reward/score model ({why}), not a causal language model: "
                         f"its LM head would be initialised at random; {_CAUSAL_LM_FIX}")


def _own_tokenizer(folder: str | None):
    """The tokenizer saved next to a local model (None for hub ids, folders without tokenizer files and
    tokenizers that do not load: the run's own tokenizer is loaded, and checked, elsewhere)."""
    if folder is None or not any(os.path.isfile(os.path.join(folder, n)) for n in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None


def check_vocab(model, tokenizer, model_path) -> None:
    """ModelLoadError when `tokenizer` has more tokens than `model`'s input embedding has rows (the
    larger ids would index past the embedding); fewer is fine (vocabularies are often padded)."""
    if tokenizer is None:
        return
    emb = model.get_input_embeddings()
    rows = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    n = len(tokenizer)
    if n > rows:
        source = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
        raise ModelLoadError(f"tokenizer {source} has {n} tokens but model {model_path} has a vocabulary of "
                             f"{rows} (input embedding rows): ids >= {rows} would index past the embedding. "
                             "Use the tokenizer the model was trained with, or resize the model's embeddings "
                             "(model.resize_token_embeddings(len(tokenizer))) and save it")


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
