"""The checks of a model folder that need no model code: the path exists (or names a hub id), the folder
holds config.json and weights, config.json is a JSON object without custom code, each safetensors header
reads. Run at start-up, before the heavy imports (torch, transformers) of the loads that follow
(`posttrain.models.loading`, which raises the same `ModelLoadError`)."""
from __future__ import annotations

import glob
import json
import os

from posttrain.utils.errors import UserError

INIT_TINY_HINT = "build one with `posttrain init-tiny --output DIR`"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class ModelLoadError(UserError, ValueError):
    """A checkpoint that cannot serve the role it was given (missing weights, the wrong kind of
    model, a tokenizer larger than the vocabulary, a missing score head); the message names the
    folder, what is wrong and the fix."""


def check_model_path(path) -> str:
    """Return `path` (user-expanded) if it is a local folder or looks like a hub id ("org/name"
    whose "org" is not a local folder); otherwise raise FileNotFoundError with the init-tiny hint."""
    p = os.path.expanduser(str(path))
    if os.path.isdir(p):
        return p
    if os.path.exists(p):
        raise ModelLoadError(f"model path {str(path)!r} is a file, not a folder: a model is a folder holding "
                             "config.json and the weights (e.g. model.safetensors); give the folder that "
                             f"holds this file, or {INIT_TINY_HINT}")
    parts = p.split("/")
    hub_like = (len(parts) == 2 and all(parts) and not p.startswith((".", "~"))
                and not os.path.isdir(parts[0]))
    if not hub_like:
        raise FileNotFoundError(f"model path {str(path)!r} not found; {INIT_TINY_HINT}")
    return p


def _checked_folder(path) -> str | None:
    """The local folder of `path` (None for a hub id), after checking that it holds a model: config.json
    and weight files, unless it is a peft adapter folder (adapter_config.json)."""
    p = check_model_path(path)
    if not os.path.isdir(p):
        return None
    names = os.listdir(p)
    if "adapter_config.json" in names and "config.json" not in names:
        return None  # a LoRA adapter: transformers loads its base model
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not any(n.endswith(_WEIGHT_SUFFIXES) or n.endswith(".index.json") for n in names):
        missing.append("weights (model.safetensors, pytorch_model.bin, ...)")
    if missing:
        only_tok = " (it holds only tokenizer files)" if any(n in _TOKENIZER_FILES for n in names) else ""
        raise ModelLoadError(f"model folder {p} has no model {' and no '.join(missing)}{only_tok}; point the "
                             "model flag at a saved model (config.json + weights), e.g. the output folder "
                             f"of a posttrain run, or {INIT_TINY_HINT}")
    _check_config(p)
    _check_safetensors(p)
    return p


def check_model_folder(path) -> str | None:
    """The checks a model load makes before it reads any weight, run alone, cheaply, at start-up (before
    the data is read): `path` is a folder (or a hub id: None) with config.json and weights; config.json is
    a JSON object without `auto_map` (custom model code, which posttrain never runs); each safetensors
    file has a readable header. ModelLoadError naming the path otherwise."""
    return _checked_folder(path)


def _check_config(folder: str) -> None:
    path = os.path.join(folder, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except UnicodeDecodeError as err:
        raise ModelLoadError(f"model config {path} is not UTF-8 text ({err.reason}); the model folder is "
                             "damaged: save or download the model again") from None
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"model config {path} is not valid JSON ({err.msg} at line {err.lineno}, column "
                             f"{err.colno}); the model folder is damaged: save or download the model "
                             f"again") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"model config {path} holds a JSON {type(config).__name__}, not an object; save "
                             f"or download the model again")
    if config.get("auto_map"):
        classes = ", ".join(f"{k}: {v}" for k, v in list(config["auto_map"].items())[:3]) \
            if isinstance(config["auto_map"], dict) else str(config["auto_map"])
        raise ModelLoadError(f"model config {path} has `auto_map` ({classes}): the model needs its own "
                             f"Python code (trust_remote_code), which posttrain does not run; use a model "
                             f"whose architecture transformers ships, or convert this one to such an "
                             f"architecture")


def _check_safetensors(folder: str) -> None:
    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        try:
            with safe_open(file, framework="numpy") as f:  # the header only: no torch
                f.keys()
        except Exception as err:  # SafetensorError: a truncated or overwritten file
            raise ModelLoadError(f"model weights {file} cannot be read ({type(err).__name__}: {err}); the "
                                 f"file is damaged or incomplete: save or download the model again") from None


def read_adapter_config(adapter_path) -> dict:
    """The adapter folder's `adapter_config.json` as a dict. FileNotFoundError when the folder
    is missing; ValueError when it is not a LoRA adapter folder (e.g. a full model)."""
    p = os.path.expanduser(str(adapter_path))
    if not os.path.isdir(p):
        raise FileNotFoundError(f"lora_path {str(adapter_path)!r}: no such folder")
    config_file = os.path.join(p, ADAPTER_CONFIG)
    if not os.path.isfile(config_file):
        full = os.path.isfile(os.path.join(p, "config.json"))
        why = ("it holds a full model (config.json), not an adapter: was it trained without "
               "--ds.lora.rank > 0? then it needs no merge" if full else "no adapter_config.json")
        raise ValueError(f"lora_path {p}: not a LoRA adapter folder ({why})")
    if not any(os.path.isfile(os.path.join(p, w)) for w in ADAPTER_WEIGHTS):
        raise ValueError(f"lora_path {p}: has {ADAPTER_CONFIG} but no adapter weights "
                         f"({' or '.join(ADAPTER_WEIGHTS)})")
    with open(config_file) as f:
        cfg = json.load(f)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{config_file}: peft_type {cfg.get('peft_type')!r} is not LORA")
    return cfg


def adapter_base(adapter_path, flag: str = "--model.base_model") -> str | None:
    """The base model an adapter folder's adapter_config.json records (`base_model_name_or_path`; None when
    it names none): an absolute path or a hub id as written, a relative path resolved against the adapter
    folder, then the current folder. A relative path found in neither place that cannot be a hub id, or a
    hub id in offline mode (HF_HUB_OFFLINE) that is not a local folder either, is a ValueError naming the
    field and the fix (`flag`, the flag that names the base instead)."""
    folder = os.path.expanduser(str(adapter_path))
    recorded = read_adapter_config(folder).get("base_model_name_or_path")
    if not recorded or os.path.isabs(os.path.expanduser(recorded)):
        return recorded
    beside = os.path.normpath(os.path.join(folder, recorded))
    for path in (beside, recorded):
        if os.path.isdir(os.path.expanduser(path)):
            return path
    from huggingface_hub import constants

    try:
        hub_id = check_model_path(recorded) and not constants.HF_HUB_OFFLINE
    except FileNotFoundError:
        hub_id = False
    if hub_id:
        return recorded
    raise ValueError(f"{os.path.join(folder, ADAPTER_CONFIG)}: base_model_name_or_path {recorded!r} is found "
                     f"neither beside the adapter ({beside}) nor in the current folder; pass the base model "
                     f"with {flag}, or write its path into base_model_name_or_path")


def check_merge_paths(adapter_path, out_dir, base_path=None) -> tuple[dict, str, str]:
    """`merge_lora`'s checks before anything loads: the adapter folder (`read_adapter_config`), its base
    (`base_path`, default the adapter's `base_model_name_or_path`; `check_model_path`), and an `out_dir` that
    is neither of them nor an adapter folder. Returns (the adapter config, the adapter folder, the base path);
    FileNotFoundError or ValueError naming the flag otherwise."""
    adapter_cfg = read_adapter_config(adapter_path)
    adapter_path = os.path.expanduser(str(adapter_path))
    base_path = str(base_path) if base_path else adapter_base(adapter_path, "--model_path")
    if not base_path:
        raise ValueError(f"{adapter_path}/{ADAPTER_CONFIG} names no base model; pass --model_path")
    base_path = check_model_path(base_path)
    out = os.path.abspath(os.path.expanduser(str(out_dir)))
    for name, p in (("lora_path", adapter_path), ("model_path", base_path)):
        if os.path.isdir(p) and os.path.abspath(p) == out:
            raise ValueError(f"output_path {out_dir} is the {name}; write the merged model to a new folder")
    if os.path.isfile(os.path.join(out, ADAPTER_CONFIG)):
        raise ValueError(f"output_path {out_dir} holds a LoRA adapter ({ADAPTER_CONFIG}); "
                         "choose another folder")
    return adapter_cfg, adapter_path, base_path


# config attributes that hold a model's position limit, most common first
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def position_limit(model_path: str) -> int | None:
    """The model's position limit (max_position_embeddings or its equivalent) from its config, or None."""
    check_model_folder(model_path)  # before transformers loads: a wrong path is reported at once
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(check_model_path(model_path))
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
