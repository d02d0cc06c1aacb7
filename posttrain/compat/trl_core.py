"""The shared core of the TRL config translations (`trl_rloo.py`: RLOOConfig <= 0.21, `trl_grpo.py`:
GRPOConfig / RLOOConfig 1.x): the report (`Line`, `Translation`), the field collector (`_Builder`), field
readers that name the field in their error, and transformers' optimizer / schedule / DeepSpeed fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from posttrain.utils.errors import ConfigError

# transformers' schedule names that posttrain runs with the same formula, each with the lr_scheduler_kwargs
# it accepts at transformers' default values (the min-LR ones also take min_lr / min_lr_rate)
_SCHEDULES: dict[str, dict[str, Any]] = {
    "linear": {}, "cosine": {"num_cycles": 0.5}, "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"power": 1.0, "lr_end": 1e-7}, "constant": {}, "constant_with_warmup": {},
    "inverse_sqrt": {"timescale": None}, "cosine_with_min_lr": {"num_cycles": 0.5},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, "warmup_lr_rate": None}}

@dataclass(frozen=True)
class Line:
    """One TRL field: its value, whether the file gave it (else TRL's default), what it became."""

    field: str
    value: Any
    given: bool
    effect: str


@dataclass
class Translation:
    values: dict[str, Any] = field(default_factory=dict)  # dotted posttrain flag path -> value
    lines: list[Line] = field(default_factory=list)
    title: str = "TRL RLOOConfig (v0.21.0 semantics)"  # the report's heading
    file: str = "trl_rloo_translation.txt"  # the report's name in the run folder

    def report(self) -> str:
        """The translation, one TRL field per line, for the start-up log and the run directory."""
        width = min(max((len(f"{ln.field}: {ln.value!r}") for ln in self.lines), default=0), 48)
        out = [f"{self.title} -> posttrain ppo:"]
        for ln in self.lines:
            head = f"{ln.field}: {ln.value!r}"
            out.append(f"  {head:<{width}}  {'' if ln.given else '(TRL default) '}-> {ln.effect}")
        return "\n".join(out)



class _Builder:
    """Collects a Translation: `given` the file's fields, `defaults` TRL's defaults of the fields read."""

    def __init__(self, given: dict[str, Any], defaults: dict[str, Any],
                 out: Translation | None = None) -> None:
        self.given = given
        self.defaults = defaults
        self.out = out or Translation()
        self.done: set[str] = set()

    def get(self, name: str) -> Any:
        return self.given.get(name, self.defaults.get(name))

    def line(self, name: str, effect: str, always: bool = True) -> None:
        """Record `name` (given or, when `always`, shown with TRL's default)."""
        self.done.add(name)
        if name in self.given or always:
            self.out.lines.append(Line(name, self.get(name), name in self.given, effect))

    def set(self, name: str, settings: dict[str, Any], why: str = "", always: bool = True) -> None:
        self.out.values.update(settings)
        flags = " ".join(f"--{k} {_show(v)}" for k, v in settings.items())
        self.line(name, flags + (f" ({why})" if why else ""), always)


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return " ".join(_show(v) for v in value) if value else "(none)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _numeric(value: Any) -> Any:
    """A number written as a string (`3e-6` is a string to YAML 1.1) as HfArgumentParser reads it."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def _field_int(name: str, value: Any, minimum: int = 1) -> int:
    value = _numeric(value)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value
        or value < minimum):
        raise ConfigError(f"TRL field {name}: {value!r} must be an integer >= {minimum}")
    return int(value)


def _field_number(name: str, value: Any) -> float:
    value = _numeric(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"TRL field {name}: {value!r} must be a number")
    return float(value)



_ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_torch_xla",
          "adamw_torch_npu_fused")



def _zero_stage(config: Any) -> int:
    """`zero_optimization.stage` of a DeepSpeed config (a dict or a JSON file)."""
    if isinstance(config, str):
        import json

        try:
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"TRL field deepspeed: cannot read the DeepSpeed config {config!r} "
                              f"({e})") from None
    stage = config.get("zero_optimization", {}).get("stage", 0) if isinstance(config, dict) else None
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"TRL field deepspeed: no zero_optimization.stage in 0..3 in {config!r}")
    return int(stage)


def _known_training_arguments() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}




def _adam(b: _Builder, clip: float, why: str) -> None:
    """transformers' optimizer fields -> posttrain's AdamW; `clip`: the gradient-norm clip of TRL's loop."""
    b.set("learning_rate", {"actor.adam.lr": _field_number("learning_rate", b.get("learning_rate")),
                            "actor.optim": "adam", "actor.max_norm": clip}, why)
    b.set("adam_beta1", {"actor.adam.betas": [_field_number("adam_beta1", b.get("adam_beta1")),
                                              _field_number("adam_beta2", b.get("adam_beta2"))]})
    b.line("adam_beta2", "with adam_beta1")
    b.set("adam_epsilon", {"actor.adam.eps": _field_number("adam_epsilon", b.get("adam_epsilon"))},
          always=False)
    b.set("weight_decay", {"actor.adam.weight_decay": _field_number("weight_decay", b.get("weight_decay"))},
          always=False)
    optim = b.given.get("optim", "adamw_torch")
    if optim not in _ADAMW:
        raise ConfigError(f"TRL field optim: {optim!r} has no posttrain equivalent (posttrain's Adam is "
                          f"torch AdamW in full precision); use one of {', '.join(_ADAMW)}")
    if "optim" in b.given:
        b.line("optim", "--actor.optim adam (AdamW)")


def _lr_schedule(b: _Builder, why: str) -> str:
    """`lr_scheduler_type` / `lr_scheduler_kwargs` -> --actor.lr_scheduler (and --actor.min_lr_ratio);
    returns the schedule's name. The warm-up fields are left to the caller (marked done here); for
    `constant` they are reported as having none."""
    name, kwargs = b.get("lr_scheduler_type"), dict(b.given.get("lr_scheduler_kwargs") or {})
    if name not in _SCHEDULES:
        raise ConfigError(f"TRL field lr_scheduler_type: {name!r} has no posttrain equivalent; "
                          f"use one of {', '.join(_SCHEDULES)}")
    floor = None
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        if "min_lr_rate" in kwargs:
            floor = _field_number("lr_scheduler_kwargs.min_lr_rate", kwargs.pop("min_lr_rate"))
        elif "min_lr" in kwargs:
            floor = _field_number("lr_scheduler_kwargs.min_lr", kwargs.pop("min_lr")) / _field_number(
                "learning_rate", b.get("learning_rate"))
        else:
            raise ConfigError(f"TRL field lr_scheduler_type: {name} needs lr_scheduler_kwargs min_lr or "
                              "min_lr_rate (transformers refuses it too)")
    for key, default in _SCHEDULES[name].items():
        if key in kwargs and _numeric(kwargs[key]) == default:
            kwargs.pop(key)
    if kwargs:
        defaults = ", ".join(f"{k}: {v}" for k, v in _SCHEDULES[name].items() if v is not None)
        raise ConfigError(f"TRL field lr_scheduler_kwargs: {sorted(kwargs)} have no posttrain equivalent for "
                          f"{name}; remove them" + (f" (posttrain runs transformers' defaults {defaults})"
                                                    if defaults else ""))
    if "lr_scheduler_kwargs" in b.given:
        b.line("lr_scheduler_kwargs", "with lr_scheduler_type")
    settings = {"actor.lr_scheduler": name} | ({"actor.min_lr_ratio": floor} if floor is not None else {})
    b.set("lr_scheduler_type", settings, why)
    b.done.update(("warmup_steps", "warmup_ratio"))
    if name == "constant":
        for field_ in ("warmup_ratio", "warmup_steps"):
            b.line(field_, "none: transformers' constant schedule has no warm-up",
                   always=field_ == "warmup_ratio")
    return name
