"""Fold a saved LoRA adapter into its base model: W ← W + (alpha / rank) B A, giving a plain
Hugging Face folder that `from_pretrained` loads without peft."""
from __future__ import annotations

import json
import os

from posttrain.models.loading import (
    check_model_path,
    load_causal_lm,
    load_score_model,
    load_tokenizer,
    read_head,
)
from posttrain.models.saving import save_pretrained
from posttrain.utils.log import info

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
REWARD_STATS = ("mean", "std", "normalize_reward")  # reward normalisation read by reward models


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


def _adapter_state(adapter_path: str) -> dict:
    from peft.utils import load_peft_weights

    return load_peft_weights(adapter_path, device="cpu")


def _has_head(keys) -> bool:
    return any(k.rsplit(".", 2)[-2] == "score" and "lora_" not in k for k in keys)


def _check_fits(peft_model, saved: dict, adapter_path: str, base_path: str) -> None:
    """Every saved adapter tensor must have a same-shaped slot in the wrapped base, and vice
    versa (peft itself silently skips adapter tensors that match no module)."""
    from peft import get_peft_model_state_dict

    slots = get_peft_model_state_dict(peft_model)
    extra = sorted(set(saved) - set(slots))
    missing = sorted(set(slots) - set(saved))
    wrong = sorted(k for k in set(saved) & set(slots) if saved[k].shape != slots[k].shape)
    if extra or missing or wrong:
        first = (f"{wrong[0]} is {tuple(saved[wrong[0]].shape)} in the adapter but "
                 f"{tuple(slots[wrong[0]].shape)} in the base" if wrong
                 else f"adapter tensor {extra[0]} has no place in the base" if extra
                 else f"the base expects {missing[0]}, which the adapter lacks")
        raise ValueError(f"lora_path {adapter_path} does not fit the base model {base_path}: {first} "
                         f"({len(wrong)} shape mismatches, {len(extra)} extra, {len(missing)} missing "
                         "tensors); "
                         "pass the model the adapter was trained on as --model_path")


def _copy_reward_stats(adapter_path: str, merged) -> None:
    cfg_file = os.path.join(adapter_path, "config.json")
    if not os.path.isfile(cfg_file):
        return
    with open(cfg_file) as f:
        cfg = json.load(f)
    for key in REWARD_STATS:
        if key in cfg:
            setattr(merged.config, key, cfg[key])


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


def merge_lora(adapter_path, out_dir, base_path=None, dtype="fp32", is_rm: bool | None = None,
               value_head_prefix: str = "score"):
    """Load the base (`base_path`, default: the adapter's `base_model_name_or_path`) in `dtype`,
    apply the adapter saved at `adapter_path`, merge it and save a plain HF folder to `out_dir`
    with the adapter folder's tokenizer (the base's if the adapter folder has none).

    is_rm: None → a reward model iff the adapter is a peft SEQ_CLS one; True → merge into a
    score model (AutoModelForSequenceClassification, num_labels=1) whose head comes from the
    adapter (peft saves it as a module to save) or else from the base's `{value_head_prefix}.*`
    tensors; reward normalisation (`mean`/`std`) in the adapter folder's config.json is kept.
    A `value_head_prefix` other than "score" also names the saved head (`{prefix}.weight`, as
    `posttrain rm --ds.value_head_prefix` saves it; load it back with that prefix).
    Raises FileNotFoundError for a missing folder and ValueError for a folder that is not an
    adapter, an adapter that does not fit the base, or a head that would be lost or random.
    Returns the merged model."""
    from peft import PeftModel

    adapter_cfg = read_adapter_config(adapter_path)
    recorded = adapter_cfg.get("base_model_name_or_path")
    base_path = str(base_path) if base_path else adapter_base(adapter_path, "--model_path")
    adapter_path = os.path.expanduser(str(adapter_path))
    if not base_path:
        raise ValueError(f"{adapter_path}/{ADAPTER_CONFIG} names no base model; pass --model_path")
    base_path = check_model_path(base_path)
    if recorded and os.path.abspath(os.path.expanduser(recorded)) != os.path.abspath(base_path):
        info(f"adapter {adapter_path} was trained on {recorded}; merging into {base_path}")
    out = os.path.abspath(os.path.expanduser(str(out_dir)))
    for name, p in (("lora_path", adapter_path), ("model_path", base_path)):
        if os.path.isdir(p) and os.path.abspath(p) == out:
            raise ValueError(f"output_path {out_dir} is the {name}; write the merged model to a new folder")
    if os.path.isfile(os.path.join(out, ADAPTER_CONFIG)):
        raise ValueError(f"output_path {out_dir} holds a LoRA adapter ({ADAPTER_CONFIG}); "
                         "choose another folder")

    info(f"merging LoRA adapter {adapter_path} into {base_path} ({dtype})")
    saved = _adapter_state(adapter_path)
    seq_cls = adapter_cfg.get("task_type") == "SEQ_CLS"
    adapter_head = _has_head(saved)
    if is_rm is None:
        is_rm = seq_cls
    elif not is_rm and (seq_cls or adapter_head):
        raise ValueError(f"lora_path {adapter_path} is a reward-model adapter (task SEQ_CLS with a score "
                         "head); merge it with --is_rm, or its head would be dropped")
    if is_rm:
        if not adapter_head and os.path.isdir(base_path) and not read_head(base_path, value_head_prefix):
            raise ValueError(f"--is_rm: neither the adapter {adapter_path} nor the base {base_path} holds a "
                             f"score head ({value_head_prefix}.weight); the merged reward model would have a "
                             "random head (set --ds.value_head_prefix to the base's head name)")
        # an adapter's own head replaces the base's, so the base's head name only matters without one
        prefix = "score" if adapter_head else value_head_prefix
        base = load_score_model(base_path, dtype, value_head_prefix=prefix, new_head_ok=adapter_head)
    else:
        base = load_causal_lm(base_path, dtype)
    try:
        peft_model = PeftModel.from_pretrained(base, adapter_path)
    except (RuntimeError, ValueError) as err:  # peft: size mismatch / target modules not found
        raise ValueError(f"lora_path {adapter_path} does not fit the base model {base_path}: "
                         f"{str(err).strip().splitlines()[-1].strip()}") from err
    _check_fits(peft_model, saved, adapter_path, base_path)
    merged = peft_model.merge_and_unload()
    if is_rm:
        _copy_reward_stats(adapter_path, merged)
        source = "the adapter" if adapter_head else f"the base ({value_head_prefix}.*)"
        info(f"score head taken from {source}")
    state = None
    if is_rm and value_head_prefix != "score":  # same layout as a fully trained RM of that prefix
        state = {(f"{value_head_prefix}{k[len('score'):]}" if k.startswith("score.") else k): v
                 for k, v in merged.state_dict().items()}
    has_tok = os.path.isfile(os.path.join(adapter_path, "tokenizer_config.json"))
    tokenizer = load_tokenizer(adapter_path if has_tok else base_path)
    save_pretrained(merged, tokenizer, out_dir, state_dict=state)
    info(f"merged model saved to {out_dir}")
    return merged
