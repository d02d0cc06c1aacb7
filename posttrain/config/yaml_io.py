"""YAML form of a config: `config_to_dict`, `save_config`, and reading `--config` files.

A file is a mapping of sections (`ds: {zero_stage: 2, lora: {rank: 8}}`), dotted keys
(`ds.zero_stage: 2`), or a mix; an optional `trainer:` key must name the trainer being run.
Every key must be a flag of that trainer (without the leading `--`)."""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from posttrain.compat.flag_migration import REMOVED, renamed
from posttrain.config.errors import ConfigError
from posttrain.config.flag_values import coerce
from posttrain.config.spec import flag_specs, is_carried, spec_map
from posttrain.config.trainers import CommandConfig


def config_to_dict(cfg: CommandConfig) -> dict[str, Any]:
    """Nested plain dict of `cfg`'s flags (sections as dicts), led by `trainer`."""
    carried = {f.name for f in dataclasses.fields(cfg) if is_carried(f)}
    flags = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in carried}
    return {"trainer": type(cfg).trainer, **flags}


def save_config(cfg: CommandConfig, path: str | os.PathLike) -> Path:
    """Write `cfg` as YAML (atomically: temp file then rename); `--config path` loads it back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False, allow_unicode=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: construct_mapping names it
                continue
            if first is not None:
                raise _DuplicateKey(f"key '{key}' is given twice in one mapping (line {first} and line "
                                    f"{key_node.start_mark.line + 1}); YAML would keep only the last, so "
                                    f"keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read the file ({e.strerror or e})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except _DuplicateKey as e:
        raise ConfigError(f"--config {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: expected a mapping of flags at the top level, got {type(data).__name__}"
        )
    return data


def _flatten(data: dict, prefix: str, sections: set[str], out: dict[str, Any], problems: list[str]) -> None:
    for key, value in data.items():
        if not isinstance(key, str):
            problems.append(f"key {key!r} under '{prefix[:-1] or 'top level'}' is not a string")
            continue
        path = prefix + key.removeprefix("--")
        if path in sections:
            if not isinstance(value, dict):
                problems.append(f"'{path}' is a section: expected a mapping, got {value!r}")
                continue
            _flatten(value, path + ".", sections, out, problems)
        elif path in out:
            problems.append(f"'{path}' is given twice")
        else:
            out[path] = value


def load_yaml_values(path: str | os.PathLike, cls: type) -> dict[str, Any]:
    """Dotted flag path -> typed value for every key of the YAML file at `path` (for config class `cls`).

    Raises one ConfigError listing every unknown key (with suggestions), wrong type and bad choice."""
    trainer = cls.trainer
    data = dict(read_yaml(path))
    problems: list[str] = []
    file_trainer = data.pop("trainer", trainer)
    if file_trainer != trainer:
        problems.append(f"trainer: the file is for {file_trainer!r} but this is posttrain {trainer}")
    specs = spec_map(cls)
    sections = {".".join(p.split(".")[:i]) for p in specs for i in range(1, p.count(".") + 1)}
    flat: dict[str, Any] = {}
    _flatten(data, "", sections, flat, problems)
    values = typed_values(flat, cls, problems)
    if problems:
        raise ConfigError.collect([f"--config {path}: {p}" for p in problems], header=f"--config {path}")
    return values


def typed_values(flat: dict[str, Any], cls: type, problems: list[str]) -> dict[str, Any]:
    """Dotted flag path -> typed value for each `flat` key of config class `cls`; an unknown key, a wrong
    type or a bad choice is appended to `problems` instead."""
    specs = spec_map(cls)
    negations = {s.negation: s for s in flag_specs(cls) if s.negation}
    values: dict[str, Any] = {}
    for key, raw in flat.items():
        spec = specs.get(key)
        if spec is None and key in negations:  # `muon.no_nesterov: true`
            spec, raw = negations[key], (not raw if isinstance(raw, bool) else raw)
        if spec is None:
            problems.append(_unknown_key(key, cls.trainer, specs))
            continue
        try:
            values[spec.path] = coerce(spec, raw)
        except ValueError as e:
            problems.append(f"'{key}': {e}")
    return values


def _unknown_key(key: str, trainer: str, specs: dict) -> str:
    flag = "--" + key
    if flag in REMOVED:
        return f"unknown key '{key}': removed in OpenRLHF 0.10.2 ({REMOVED[flag]})"
    new, why = renamed(flag, trainer)
    if new is not None and new.split()[0][2:] in specs:
        target, *value = new.split(maxsplit=1)
        return f"unknown key '{key}': {why}; use '{target[2:]}'" + (f" ({value[0]})" if value else "")
    close = difflib.get_close_matches(key, sorted(specs), n=1, cutoff=0.75)
    if close:
        return f"unknown key '{key}'; did you mean '{close[0]}'?"
    return f"unknown key '{key}' (not a flag of posttrain {trainer})"
