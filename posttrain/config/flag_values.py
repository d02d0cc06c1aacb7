"""Typed values for flags: parse command-line strings and check YAML values against a `FlagSpec`.

Both paths raise `ValueError` with a short reason ("expected an integer, got 'x'"); the callers prefix
the flag or YAML key."""

from __future__ import annotations

import math
from typing import Any

from posttrain.config.spec import FlagSpec

_NONE_WORDS = ("none", "null")
_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _choices_text(spec: FlagSpec) -> str:
    vals = list(spec.choices or ())
    if spec.optional:
        vals.append("None")
    return ", ".join(str(v) for v in vals)


def check_flag_choice(spec: FlagSpec, value: Any) -> None:
    if spec.choices is None or value is None:
        return
    if value not in spec.choices:
        alias = spec.aliases.get(str(value).strip().lower().replace("-", "_"))
        hint = f"; {value} is called {alias} here ({spec.flag} {alias})" if alias else ""
        raise ValueError(f"invalid choice {value!r}{hint}; valid values: {_choices_text(spec)}")


def parse_scalar(spec: FlagSpec, text: str) -> Any:
    """One command-line token -> element value of `spec` (choices checked)."""
    base = spec.base
    if spec.optional and base in (int, float) and text.strip().lower() in _NONE_WORDS:
        return None
    try:
        if base is int:
            try:
                value: Any = int(text)
            except ValueError:
                f = float(text)  # accept 1e6 for integer flags when it is integral
                if not (math.isfinite(f) and f.is_integer()):
                    raise
                value = int(f)
        elif base is float:
            value = float(text)
        elif base is bool:
            value = _parse_bool(text)
        else:
            value = text
    except ValueError:
        raise ValueError(f"expected {_TYPE_WORDS[base]}, got {text!r}") from None
    check_flag_choice(spec, value)
    return value


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


def _coerce_scalar(spec: FlagSpec, value: Any) -> Any:
    base = spec.base
    if value is None:
        if spec.optional:
            return None
        raise ValueError(f"expected {_TYPE_WORDS[base]}, got null")
    if base is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {value!r}")
    if base is str:
        if isinstance(value, (list, dict)):
            raise ValueError(f"expected a string, got {value!r}")
        out = str(value)  # `key: true` for --logger.wandb.key, numbers as text
        check_flag_choice(spec, out)
        return out
    if isinstance(value, bool):
        raise ValueError(f"expected {_TYPE_WORDS[base]}, got {value!r}")
    if isinstance(value, (int, float)):
        if base is int:
            if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            out = int(value)
        else:
            out = float(value)
        check_flag_choice(spec, out)
        return out
    if isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
        return parse_scalar(spec, value)
    raise ValueError(f"expected {_TYPE_WORDS[base]}, got {value!r}")


def coerce(spec: FlagSpec, value: Any) -> Any:
    """A YAML (or Python) value -> the value of `spec`, or ValueError."""
    if not spec.is_list:
        return _coerce_scalar(spec, value)
    if value is None:
        if spec.optional:
            return None
        raise ValueError("expected a list, got null")
    if not isinstance(value, (list, tuple)):
        if spec.nargs in ("*", "+"):
            value = [value]
        else:
            raise ValueError(f"expected a list of {spec.nargs} values, got {value!r}")
    if isinstance(spec.nargs, int) and len(value) != spec.nargs:
        raise ValueError(f"expected {spec.nargs} values, got {len(value)}")
    return [_coerce_scalar(spec, v) for v in value]


def format_value(value: Any) -> str:
    """A value the way it would be typed after its flag."""
    if isinstance(value, list):
        return " ".join(format_value(v) for v in value)
    if isinstance(value, str):
        return repr(value) if (not value or any(c.isspace() for c in value)) else value
    return str(value)


def parse_probs(text: str | None) -> list[float] | None:
    """Mixing probabilities as typed: '0.3,0.7' -> [0.3, 0.7]; None or '' -> None (ValueError on a
    non-number). The flag's rules (one per dataset, >= 0, sum 1) are checked by validation and again where
    data is mixed."""
    if text is None or str(text).strip() == "":
        return None
    return [float(p) for p in str(text).split(",")]
