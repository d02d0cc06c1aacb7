"""LoRA adapters via peft: W x + (alpha / rank) * B A x on the target linear layers only.

Only the A/B matrices train (the base weights are frozen), except `modules_to_save`
(e.g. a reward model's fresh score head).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.models.saving import unwrap_model
from posttrain.utils.errors import UserError
from posttrain.utils.log import info


@dataclass
class LoraSpec:
    """rank 0 disables LoRA. `target_modules`: a list of module-name suffixes
    (e.g. ["q_proj", "v_proj"]) or "all-linear" (every linear layer but the output head)."""
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | str = field(default="all-linear")

    @property
    def scaling(self) -> float:
        """`s` = alpha / rank, what `apply_lora`'s peft layers scale by (no rsLoRA)."""
        return self.alpha / self.rank

    @property
    def targets(self) -> list[str] | str:
        """The adapted modules' last name parts, or "all-linear"."""
        return _targets(self.target_modules)


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


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def adapted_linears(model: torch.nn.Module, targets: list[str] | str, task_type: str) -> dict:
    """name -> linear layer, for the layers peft gives adapters: those whose last name part is a target, or
    with all-linear every `nn.Linear` but the output head (a causal LM's LM head, a classifier's score
    head)."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if targets != "all-linear":
        return {n: m for n, m in linears.items() if _short(n) in targets}
    get_head = getattr(model, "get_output_embeddings", None)
    heads = [get_head() if get_head else None]
    if task_type == "SEQ_CLS":
        heads += [getattr(model, n, None) for n in ("score", "classifier")]
    return {n: m for n, m in linears.items() if not any(m is h for h in heads)}


def _not_linear(model: torch.nn.Module) -> list[str]:
    """Last name parts of the modules that hold weight matrices outside torch's own layers (a mixture of
    experts' fused expert tensors and router): LoRA, which adapts linear layers, leaves them frozen."""
    return sorted({_short(n) for n, m in model.named_modules()
                   if not type(m).__module__.startswith("torch.nn") and not isinstance(m, torch.nn.Linear)
                   and any(p.dim() >= 2 for p in m.parameters(recurse=False))})


_noted: set[str] = set()


class LoraError(UserError, ValueError):
    """`--ds.lora.*` that cannot work on this model (a target it lacks, a rank beyond its layers)."""


def check_lora(model: torch.nn.Module, spec: LoraSpec, task_type: str) -> None:
    """LoraError when `--ds.lora.target_modules` names no linear layer of `model`, or `--ds.lora.rank` exceeds
    min(in, out) of every layer it adapts (more rank adds parameters, no capacity); a start-up note naming the
    adapted layers narrower than the rank (e.g. a mixture of experts' 1-wide shared-expert gate), and with
    all-linear one naming the weights that get no adapter (a mixture of experts' experts and router)."""
    targets = _targets(spec.target_modules)
    if targets != "all-linear":
        present = {_short(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        missing = [t for t in targets if t not in present]
        if missing:
            other = ", ".join(t for t in missing if t in _not_linear(model))
            why = f" ({other}: weights outside linear layers, which LoRA cannot adapt)" if other else ""
            raise LoraError(f"--ds.lora.target_modules {' '.join(missing)}: no linear layer of this model has"
                            f" that name{why}; its linear layers are {' '.join(sorted(present))} (or use "
                            "all-linear)")
    layers = adapted_linears(model, targets, task_type)
    width = {n: min(m.in_features, m.out_features) for n, m in layers.items()}
    if layers:
        name = max(width, key=width.get)
        m, largest = layers[name], width[name]
        if spec.rank > largest:
            raise LoraError(f"--ds.lora.rank {spec.rank} exceeds every layer it adapts (the largest, {name}: "
                            f"{m.in_features} -> {m.out_features}), where a rank above {largest} adds "
                            f"parameters but no capacity; use --ds.lora.rank {largest} or less")
    narrow = sorted({_short(n) for n, w in width.items() if w < spec.rank})
    note = (f"note: --ds.lora.rank {spec.rank} exceeds min(in, out) of {' '.join(narrow)}; their adapters "
            "get parameters beyond that width but no more capacity")
    if narrow and note not in _noted:
        _noted.add(note)
        info(note)
    skipped = _not_linear(model) if targets == "all-linear" else []
    adapted = " ".join(sorted({_short(n) for n in layers}))
    note = (f"note: --ds.lora.target_modules all-linear adapts the linear layers ({adapted}); "
            f"{' '.join(skipped)} hold weights outside linear layers, so they get no adapter and stay frozen")
    if skipped and note not in _noted:
        _noted.add(note)
        info(note)


def apply_lora(model: torch.nn.Module, lora, task_type: str = "CAUSAL_LM",
               modules_to_save: list[str] | None = None) -> torch.nn.Module:
    """Wrap `model` in a peft LoRA model (returns it unchanged when LoRA is off), after `check_lora`."""
    spec = as_lora_spec(lora)
    if spec is None:
        return model
    from peft import LoraConfig, get_peft_model

    check_lora(model, spec, task_type)
    targets = _targets(spec.target_modules)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                        target_modules=targets, bias="none", task_type=task_type,
                        modules_to_save=modules_to_save)
    return get_peft_model(model, config)


def is_peft(model: torch.nn.Module) -> bool:
    """`model` (or the net an engine wraps) is a peft model."""
    return hasattr(unwrap_model(model), "peft_config")


def lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """module name (as in `state_dict`) -> the scale `s` of its active adapter (alpha / rank), for
    every LoRA layer of a peft model."""
    return {name: float(m.scaling["default"]) for name, m in unwrap_model(model).named_modules()
            if hasattr(m, "lora_A") and isinstance(getattr(m, "scaling", None), dict)}


def tied_lora_layers(model: torch.nn.Module) -> list[str]:
    """LoRA layers whose base weight is tied to another weight (an output head with tied embeddings):
    their merged weight cannot be loaded into a plain model without changing the tied twin too."""
    params = list(unwrap_model(model).named_parameters(remove_duplicate=False))
    count: dict[int, int] = {}
    for _, p in params:
        count[_storage_key(p)] = count.get(_storage_key(p), 0) + 1
    return sorted(n.removesuffix(".base_layer.weight") for n, p in params
                  if n.endswith(".base_layer.weight") and count[_storage_key(p)] > 1)


def _storage_key(p: torch.Tensor) -> int:
    """What tied weights share: their storage, or under ZeRO-3 (every partitioned weight's `data` is one
    empty tensor) their DeepSpeed id."""
    return p.ds_id if hasattr(p, "ds_id") else p.data_ptr()


def base_name(name: str) -> str | None:
    """A peft state-dict name under the base model's own names (peft's `base_model.model.` prefix,
    `.base_layer` and `.modules_to_save.default` dropped; None: peft's `original_module` copies)."""
    if ".original_module." in name:
        return None
    name = name.removeprefix("base_model.model.")
    return name.replace(".modules_to_save.default.", ".").replace(".base_layer.", ".")


def trainable_names(model: torch.nn.Module) -> set[str]:
    """The `state_dict` names of the parameters that train (`requires_grad`)."""
    return {n for n, p in unwrap_model(model).named_parameters() if p.requires_grad}
