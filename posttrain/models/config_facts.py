"""What a model's config says, read without torch: whether it is a vision-language model, whether it is a
mixture of experts, and whether its shapes divide by a tensor-parallel size. The start-up checks
(`trainers/inputs.py`) call these before any heavy import, so a mistake is reported in well under a second."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from posttrain.config.validate import tensor_parallel_refusal
from posttrain.utils.errors import ConfigError

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def text_config(config):
    return getattr(config, "text_config", None) or config


def is_moe(model_or_config) -> bool:
    """A mixture-of-experts model (or config): it names a number of experts and of experts per token."""
    config = text_config(getattr(model_or_config, "config", model_or_config))
    experts = any(getattr(config, k, None) for k in EXPERT_COUNT_KEYS)
    return experts and bool(getattr(config, "num_experts_per_tok", None))


def is_vision_config(config) -> bool:
    """Whether an HF config (or its dict) describes a VLM: it has a `vision_config`."""
    if isinstance(config, dict):
        return bool(config.get("vision_config"))
    return getattr(config, "vision_config", None) is not None


def is_vision_folder(path) -> bool:
    """Whether the model at `path` is a VLM (its config has a `vision_config`): a local folder's config.json,
    or a hub id's config through `AutoConfig` (False when it cannot be read: the loader names that error)."""
    cfg = os.path.join(str(path), "config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            return is_vision_config(json.load(f))
    if os.path.isdir(str(path)):
        return False
    try:
        from transformers import AutoConfig

        return is_vision_config(AutoConfig.from_pretrained(str(path)))
    except (OSError, ValueError):
        return False


def check_tensor_parallel_config(config: dict, size: int) -> None:
    """The model's config.json (`text_config` for a VLM) against `size`: not a mixture of experts (its
    expert blocks have no split here); attention heads, key/value heads and the MLP width divide by it (each
    rank keeps whole heads); ConfigError otherwise."""
    text = config.get("text_config") or config
    if is_moe(SimpleNamespace(**text)):
        raise ConfigError(tensor_parallel_refusal(
            size, "mixture-of-experts models have no tensor-parallel split in this version (their expert "
            "blocks would need one); use ZeRO-3 to spread the experts"))
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        fallback = text.get("num_attention_heads") if key == "num_key_value_heads" else None
        value = text.get(key, fallback)
        if isinstance(value, int) and value % size:
            raise ConfigError(tensor_parallel_refusal(
                size, f"the model's {key} ({value}) is not divisible by {size}; each rank keeps whole heads "
                "and an equal share of the MLP"))


def check_tensor_parallel_folder(path, size: int) -> None:
    """`check_tensor_parallel_config` on a local model folder's config.json (a hub id is checked when it
    loads)."""
    config = Path(path) / "config.json"
    if config.is_file():
        check_tensor_parallel_config(json.loads(config.read_text(encoding="utf-8")), size)


def vocab_size_of(path) -> int | None:
    """The `vocab_size` (the width of the logits) in a local model folder's config.json (`text_config` for a
    VLM); None for a hub id or a config without one (the loaded models are compared at the first forward)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text(encoding="utf-8"))
    size = (data.get("text_config") or data).get("vocab_size", data.get("vocab_size"))
    return int(size) if isinstance(size, int) else None
