"""LoRA adapters via peft: W x + (alpha / rank) * B A x on the target linear layers only.

Only the A/B matrices train (the base weights are frozen), except `modules_to_save`
(e.g. a reward model's fresh score head).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoraSpec:
    """rank 0 disables LoRA. `target_modules`: a list of module-name suffixes
    (e.g. ["q_proj", "v_proj"]) or "all-linear" (every linear layer but the output head)."""
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default="all-linear")


def as_lora_spec(lora) -> LoraSpec | None:
    """Accept None, a LoraSpec, a dict or any object with rank/alpha/dropout/target_modules
    (e.g. `cfg.ds.lora`). Returns None when LoRA is off (None or rank 0)."""
    if lora is None:
        return None
    if isinstance(lora, LoraSpec):
        spec = lora
    else:
        if isinstance(lora, dict):
            unknown = set(lora) - {"rank", "alpha", "dropout", "target_modules"}
            if unknown:
                raise ValueError(f"lora: unknown keys {sorted(unknown)}; valid keys are rank, alpha, "
                                 "dropout, target_modules")
            get = lora.get
        else:
            def get(key, default=None):
                return getattr(lora, key, default)
        spec = LoraSpec(rank=get("rank", 0) or 0, alpha=get("alpha", 16.0),
                        dropout=get("dropout", 0.0) or 0.0,
                        target_modules=get("target_modules", "all-linear") or "all-linear")
    if spec.rank < 0:
        raise ValueError(f"lora.rank={spec.rank}: must be >= 0 (0 disables LoRA)")
    if not 0.0 <= spec.dropout < 1.0:
        raise ValueError(f"lora.dropout={spec.dropout}: must be in [0, 1)")
    return spec if spec.rank > 0 else None


def _targets(target_modules) -> list[str] | str:
    if isinstance(target_modules, str):
        if target_modules.strip() == "all-linear":
            return "all-linear"
        names = target_modules.replace(",", " ").split()
    else:
        names = list(target_modules)
    if names == ["all-linear"]:
        return "all-linear"
    if not names:
        raise ValueError("lora.target_modules is empty: give module names (e.g. q_proj v_proj) or all-linear")
    return names


def apply_lora(model: torch.nn.Module, lora, task_type: str = "CAUSAL_LM",
               modules_to_save: list[str] | None = None) -> torch.nn.Module:
    """Wrap `model` in a peft LoRA model (returns it unchanged when LoRA is off). A target
    name that matches no module raises ValueError naming `lora.target_modules`."""
    spec = as_lora_spec(lora)
    if spec is None:
        return model
    from peft import LoraConfig, get_peft_model

    targets = _targets(spec.target_modules)
    if targets != "all-linear":
        present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        missing = [t for t in targets if t not in present]
        if missing:
            raise ValueError(f"lora.target_modules {missing} match no linear layer of this model; "
                             f"its linear layers are {sorted(present)} (or use all-linear)")
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=targets, bias="none", task_type=task_type,
                        modules_to_save=modules_to_save)
    return get_peft_model(model, config)
