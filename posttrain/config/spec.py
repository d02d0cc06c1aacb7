"""Flag specifications derived from the config dataclasses.

A config field is declared with `opt(default, help, ...)`; its dotted path in the dataclass tree is
its flag name (`cfg.ds.lora.rank` <-> `--ds.lora.rank`). `flag_specs(cls)` walks a top-level config
class and returns one `FlagSpec` per leaf field, with the trainer-specific default read from a fresh
instance (so per-trainer defaults set through `default_factory` are honoured).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_SCALARS = (bool, int, float, str)


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    aliases: dict | None = None,
    nargs: int | str | None = None,
    negation: str | None = None,
    extension: bool = False,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    finite: bool = False,
    note: str = "",
    check: Callable[[Any], bool | str] | None = None,
    message: str | None = None,
    required: str | None = None,
    inert: Any = (),
    on_resume: str | dict | None = None,
) -> Any:
    """Declare a config field with every fact that concerns it alone.

    choices: allowed values (None stays allowed for Optional fields). aliases: names other tools give a
    choice (lower case, `_` for `-`) -> that choice, named in the refusal of such a name.
    nargs: 2, "*" or "+" (one or more) for list fields.
    negation: name of a companion store_false flag for a default-True boolean (`no_nesterov`).
    extension: the flag is a posttrain addition that OpenRLHF 0.10.2 does not have.
    ge / gt / le / lt / finite: the range of the value (of each element of a list; None is always
    allowed for an Optional field); a value outside it is refused as "must be >= 1" etc. followed by
    `note` (units or meaning, e.g. "seconds", "(0: no clipping)"). check: a predicate for what a range
    cannot say, refused with `message` (which also replaces the generated range text when given); a
    check may instead return the problem itself as a string.
    inert: one `posttrain.config.facts.Inert` or a tuple of them: when setting the flag has no effect
    (reported at start-up, never silent); the first that applies is reported, its own before those
    declared on its enclosing sections.
    on_resume: what a different value means when a run resumes a checkpoint (`config/fingerprint.py`):
    "trajectory" (the default: it decides what is trained, so the resume is refused), "adjustable" (run
    length or execution: allowed and named in a note) or "volatile" (never changes training); a dict
    {trainer: kind, "*": kind} where it differs by trainer. None: the enclosing section's, else trajectory.
    """
    md = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "aliases": dict(aliases or {}),
        "nargs": nargs,
        "negation": negation,
        "extension": extension,
        "bounds": Bounds(ge, gt, le, lt, finite, note, check, message, required),
        "inert": _facts(inert),
        "on_resume": on_resume,
    }
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata=md)
    return field(default=default, metadata=md)


def carried(help: str) -> Any:
    """A config field that is not a flag: what the config carries from where it was made (default None). It is
    not parsed, listed by `flag_specs`, written to YAML (`config_to_dict`) or compared."""
    return field(default=None, repr=False, compare=False, metadata={"carried": help})


def is_carried(f: dataclasses.Field) -> bool:
    return "carried" in f.metadata


@dataclass
class ParsedFields:
    """The carried fields of every command's config (`carried`: not flags, not in YAML, not compared, not
    echoed). `flag_sources`: dotted path -> where the user set it (`flag_sources`), for every flag the
    parser was given; None for a config built in code. `resolved`: dotted path -> (value asked for,
    value used, reason) for every value start-up or validation resolved (`hardware.record_resolved`)."""
    flag_sources: dict[str, str] | None = carried("where each flag the parser was given was set")
    resolved: dict[str, tuple[Any, Any, str]] | None = carried("the values start-up resolved, and why")


def section(cls: type, *, inert: Any = (), on_resume: str | None = None, **overrides: Any) -> Any:
    """A nested section field whose defaults differ from `cls`'s by `overrides` (deep-copied per
    instance); `inert` facts apply to every flag inside it (after each flag's own), and `on_resume` to every
    flag inside it that declares none."""
    return field(default_factory=lambda: cls(**copy.deepcopy(overrides)),
                 metadata={"inert": _facts(inert), "on_resume": on_resume})


RESUME_KINDS = ("trajectory", "adjustable", "volatile")


def _resume_kind(declared: str | dict | None, trainer: str | None) -> str | None:
    if isinstance(declared, dict):
        declared = declared.get(trainer, declared.get("*"))
    if declared is not None and declared not in RESUME_KINDS:
        raise TypeError(f"on_resume={declared!r}: one of {RESUME_KINDS}")
    return declared


def _facts(inert: Any) -> tuple:
    """One fact (a `facts.Inert`, itself a named tuple) or several, as a tuple of facts."""
    return (inert,) if hasattr(inert, "reason") else tuple(inert)


def _shown(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Bounds:
    """The range (and any other single-value rule) a field declares; `problem(value)` says what is wrong."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False
    note: str = ""
    check: Callable[[Any], bool | str] | None = None
    message: str | None = None
    required: str | None = None

    def range_text(self) -> str:
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt) if self.gt is not None else None
        high = ("]", self.le) if self.le is not None else (")", self.lt) if self.lt is not None else None
        if low and high:
            text = f"in {low[0]}{_shown(low[1])}, {_shown(high[1])}{high[0]}"
        elif low:
            text = (">= " if low[0] == "[" else "> ") + _shown(low[1])
        elif high:
            text = ("<= " if high[0] == "]" else "< ") + _shown(high[1])
        else:
            text = ""
        if self.finite:
            text = "a finite number" + (f" {text}" if text else "")
        return text

    def in_range(self, v: Any) -> bool:
        if self.finite and not math.isfinite(v):
            return False
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused, or None. None values are the Optional fields' "unset"."""
        if self.required and (value is None or value == ""):
            return f"required: {self.required}"
        if value is None:
            return None
        text = self.range_text()
        values = value if isinstance(value, list) else [value]
        numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        checked = True if self.check is None else self.check(value)
        if isinstance(checked, str):
            return checked
        if (text and not all(self.in_range(v) for v in numeric)) or not checked:
            why = self.message or f"must be {text}"
            return f"{why} {self.note}" if self.note else why
        return None


@dataclass(frozen=True)
class FlagSpec:
    path: str  # dotted path, e.g. "ds.lora.rank"; the flag is "--" + path
    base: type  # bool | int | float | str (element type for lists)
    optional: bool  # None is a valid value
    is_list: bool
    nargs: int | str | None
    default: Any
    help: str
    choices: tuple | None
    negation: str | None  # dotted path of the store_false companion flag, if any
    extension: bool
    section: str  # dotted path of the owning section ("" for flat flags)
    bounds: Bounds = Bounds()
    inert: tuple = ()  # `facts.Inert`s: its own, then those of its enclosing sections
    on_resume: str = "trajectory"  # what a changed value means on resume (`opt(on_resume=...)`)
    aliases: dict = field(default_factory=dict)  # other tools' names of a choice -> it (`opt(aliases=)`)

    def problem(self, value: Any) -> str | None:
        """Why `value` is refused by this flag's own declaration (range, check), or None."""
        return self.bounds.problem(value)

    @property
    def flag(self) -> str:
        return "--" + self.path

    @property
    def negation_flag(self) -> str | None:
        return None if self.negation is None else "--" + self.negation


def _unwrap(hint: Any) -> tuple[type, bool, bool]:
    """(element type, optional, is_list) of a field annotation."""
    optional = False
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            raise TypeError(f"unsupported field type {hint!r}")
        hint = args[0]
        origin = typing.get_origin(hint)
    if origin is list:
        (elem,) = typing.get_args(hint)
        return elem, optional, True
    return hint, optional, False


def is_section(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


@functools.cache
def flag_specs(cls: type) -> tuple[FlagSpec, ...]:
    """All leaf flags of config class `cls`, in declaration order (flat fields and sections)."""
    out: list[FlagSpec] = []

    trainer = getattr(cls, "trainer", None)

    def walk(obj: Any, prefix: str, inherited: tuple, resume: str | None) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            if is_carried(f):
                continue
            value = getattr(obj, f.name)
            path = prefix + f.name
            if is_section(value):
                walk(value, path + ".", f.metadata.get("inert", ()) + inherited,
                     _resume_kind(f.metadata.get("on_resume"), trainer) or resume)
                continue
            base, optional, is_list = _unwrap(hints[f.name])
            if base not in _SCALARS:
                raise TypeError(f"{path}: unsupported field type {hints[f.name]!r}")
            md = f.metadata
            if "help" not in md:
                raise TypeError(f"{path}: declare config fields with opt(...)")
            neg = md["negation"]
            out.append(
                FlagSpec(
                    path=path,
                    base=base,
                    optional=optional,
                    is_list=is_list,
                    nargs=md["nargs"],
                    default=copy.deepcopy(value),
                    help=md["help"],
                    choices=md["choices"],
                    aliases=md["aliases"],
                    negation=(prefix + neg) if neg else None,
                    extension=md["extension"],
                    section=prefix[:-1],
                    bounds=md["bounds"],
                    inert=md["inert"] + inherited,
                    on_resume=_resume_kind(md["on_resume"], trainer) or resume or "trajectory",
                )
            )

    walk(cls(), "", (), None)
    return tuple(out)


def spec_map(cls: type) -> dict[str, FlagSpec]:
    return {s.path: s for s in flag_specs(cls)}


def get_path(cfg: Any, path: str) -> Any:
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def set_path(cfg: Any, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    obj = cfg
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)


def flag_sources(cfg: ParsedFields) -> dict[str, str]:
    """Dotted path -> where the user set it ("command line", "--config FILE", "TRL config FILE") for every
    flag the parser was given, in the order of the config's flags; {} for a config built in code."""
    return dict(cfg.flag_sources or {})


def changed_values(cfg: Any) -> dict[str, Any]:
    """Dotted path -> value for every flag whose value differs from this trainer's default."""
    return {
        s.path: get_path(cfg, s.path) for s in flag_specs(type(cfg)) if get_path(cfg, s.path) != s.default
    }
