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
import types
import typing
from dataclasses import dataclass, field
from typing import Any

_SCALARS = (bool, int, float, str)


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    nargs: int | str | None = None,
    negation: str | None = None,
    extension: bool = False,
) -> Any:
    """Declare a config field.

    choices: allowed values (None stays allowed for Optional fields). nargs: 2 or "*" for list fields.
    negation: name of a companion store_false flag for a default-True boolean (`no_nesterov`).
    extension: the flag is a posttrain addition that OpenRLHF 0.10.2 does not have.
    """
    md = {
        "help": help,
        "choices": tuple(choices) if choices else None,
        "nargs": nargs,
        "negation": negation,
        "extension": extension,
    }
    if isinstance(default, list):
        return field(default_factory=functools.partial(list, default), metadata=md)
    return field(default=default, metadata=md)


def section(cls: type, **overrides: Any) -> Any:
    """A nested section field whose defaults differ from `cls`'s by `overrides` (deep-copied per instance)."""
    return field(default_factory=lambda: cls(**copy.deepcopy(overrides)))


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

    def walk(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            path = prefix + f.name
            if is_section(value):
                walk(value, path + ".")
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
                    negation=(prefix + neg) if neg else None,
                    extension=md["extension"],
                    section=prefix[:-1],
                )
            )

    walk(cls(), "")
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


def changed_values(cfg: Any) -> dict[str, Any]:
    """Dotted path -> value for every flag whose value differs from this trainer's default."""
    return {
        s.path: get_path(cfg, s.path) for s in flag_specs(type(cfg)) if get_path(cfg, s.path) != s.default
    }
