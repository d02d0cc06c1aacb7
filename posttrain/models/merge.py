"""Fold a saved LoRA adapter into its base model: W ← W + (alpha / rank) B A, giving a plain
Hugging Face folder that `from_pretrained` loads without peft."""
from __future__ import annotations

import json
import os
import shutil

from posttrain.models.folders import adapter_base, check_merge_paths
from posttrain.models.loading import (
    load_causal_lm,
    load_score_model,
    load_tokenizer,
    read_head,
)
from posttrain.models.prm_spec import PRM_SPEC_FILE
from posttrain.models.saving import save_pretrained
from posttrain.utils.log import info

REWARD_STATS = ("mean", "std", "normalize_reward")  # reward normalisation read by reward models


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

    given = base_path
    adapter_cfg, adapter_path, base_path = check_merge_paths(adapter_path, out_dir, base_path)
    recorded = adapter_cfg.get("base_model_name_or_path")
    if given and recorded:  # another base than the one the adapter records (resolved as `adapter_base` does)
        try:
            recorded_path = adapter_base(adapter_path)
        except ValueError:  # the recorded base is found nowhere: certainly another one
            recorded_path = recorded
        if os.path.abspath(os.path.expanduser(recorded_path)) != os.path.abspath(base_path):
            info(f"adapter {adapter_path} was trained on {recorded}; merging into {base_path}")

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
    spec = os.path.join(adapter_path, PRM_SPEC_FILE)  # a process reward model's step description
    if os.path.isfile(spec):
        shutil.copy(spec, os.path.join(out_dir, PRM_SPEC_FILE))
    info(f"merged model saved to {out_dir}")
    return merged
