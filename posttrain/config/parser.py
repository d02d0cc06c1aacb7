"""The dotted-flag command line: an argparse parser generated from the config dataclasses, `--config`
YAML files underneath it, and `parse_config` tying both to validation.

Precedence: trainer defaults < `--config run.yaml` < flags on the command line. Booleans are
store_true flags (plus `--muon.no_nesterov`-style negations); list flags take their values as
separate tokens (`--adam.betas 0.9 0.95`); `--flag=value` works too. Any number is a value, negative
ones included (`--adam.lr -1e-3`, `--reward.clip_range -.5 5`): validation, not the parser, decides
whether it is in range. Prefix abbreviations are not accepted (a typo must not silently hit another
flag)."""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import warnings
from typing import Any

from posttrain.compat.flag_migration import explain_unknown
from posttrain.compat.trl_grpo import is_trl_config, translate_trl
from posttrain.compat.trl_rloo import Translation, translate_rloo
from posttrain.config.errors import ConfigError, ConfigWarning
from posttrain.config.flag_values import parse_scalar
from posttrain.config.spec import FlagSpec, flag_specs, set_path
from posttrain.config.trainers import COMMAND_CONFIGS, CONFIG_CLASSES, TRAINERS, config_class
from posttrain.config.yaml_io import load_yaml_values, read_yaml, typed_values

# A token that is a negative number (as Python's float() reads it), or a comma-separated list of numbers
# starting with one (`--data.dataset_probs -1,2`), hence a value and never a flag: validation then names
# what is wrong with it. argparse's own pattern misses exponents (-1e-3) and lists, and would report
# "expected one argument".
_NUMBER = r"(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(e[-+]?\d[\d_]*)?|inf(inity)?"
_NEGATIVE_NUMBER = re.compile(rf"^-({_NUMBER})(\s*,\s*-?({_NUMBER}))*$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER  # no flag looks like a number, so this is safe

    def error(self, message: str):  # argparse would print and exit; we raise a ConfigError instead
        raise ConfigError(re.sub(r"^argument ([^:]+): ", r"\1: ", message))


def _converter(spec: FlagSpec):
    def convert(text: str) -> Any:
        try:
            return parse_scalar(spec, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = spec.base.__name__
    return convert


def _help(spec: FlagSpec) -> str:
    text = ("[posttrain] " if spec.extension else "") + spec.help
    default = spec.default
    shown = (
        " ".join(map(str, default))
        if isinstance(default, list)
        else repr(default)
        if default == ""
        else default
    )
    return f"{text} (default: {shown})".replace("%", "%%")


def _metavar(spec: FlagSpec) -> str:
    if spec.choices:
        return "{" + ",".join(map(str, spec.choices)) + "}"
    return {int: "INT", float: "FLOAT", str: "STR"}[spec.base]


def build_parser(trainer: str) -> argparse.ArgumentParser:
    """argparse parser with every flag of `trainer`, one help group per section."""
    cls = config_class(trainer)
    parser = _Parser(
        prog=f"posttrain {trainer}",
        usage="%(prog)s [--config RUN.YAML] [--section.flag VALUE ...]",
        description=(cls.__doc__ or "").strip(),
        allow_abbrev=False,
        epilog="Flags follow OpenRLHF 0.10.2 names; [posttrain] marks additions.",
    )
    parser.add_argument(
        "--config",
        metavar="RUN.YAML",
        help="YAML file of flag values (nested sections or dotted keys); command-line flags win",
    )
    groups: dict[str, Any] = {}
    for spec in flag_specs(cls):
        if spec.section not in groups:
            title = spec.section or "top-level flags"
            doc = _section_doc(cls, spec.section) if spec.section else "flags without a section prefix"
            groups[spec.section] = parser.add_argument_group(title, doc)
        group = groups[spec.section]
        if spec.base is bool and not spec.is_list and not spec.optional:
            group.add_argument(
                spec.flag, dest=spec.path, action="store_true", default=spec.default, help=_help(spec)
            )
            if spec.negation_flag:
                group.add_argument(
                    spec.negation_flag, dest=spec.path, action="store_false", help=f"turn off {spec.flag}"
                )
            continue
        kwargs: dict[str, Any] = {
            "dest": spec.path,
            "type": _converter(spec),
            "default": copy.deepcopy(spec.default),
            "metavar": _metavar(spec),
            "help": _help(spec),
        }
        if spec.is_list:
            kwargs["nargs"] = spec.nargs
        group.add_argument(spec.flag, **kwargs)
    return parser


def _section_doc(cls: type, path: str) -> str:
    obj: Any = cls()
    for part in path.split("."):
        obj = getattr(obj, part)
    first_paragraph = (type(obj).__doc__ or "").strip().split("\n\n")[0]
    return " ".join(first_paragraph.split()).replace("%", "%%")


def _config_path(argv: list[str]) -> str | None:
    path = None
    for i, tok in enumerate(argv):
        if tok == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError("--config: expected a YAML file path")
            path = argv[i + 1]
        elif tok.startswith("--config="):
            path = tok.split("=", 1)[1]
    return path


def flag_owners() -> dict[str, list[str]]:
    """flag -> trainers that accept it (negation flags included)."""
    owners: dict[str, list[str]] = {}
    for name, cls in CONFIG_CLASSES.items():
        for spec in flag_specs(cls):
            for flag in (spec.flag, spec.negation_flag):
                if flag:
                    owners.setdefault(flag, []).append(name)
    return owners


def known_flags(trainer: str) -> set[str]:
    """Every flag `trainer` accepts (including negations like --muon.no_nesterov and --config)."""
    out = {"--config"}
    for spec in flag_specs(config_class(trainer)):
        out.add(spec.flag)
        if spec.negation_flag:
            out.add(spec.negation_flag)
    return out


def _unknown_error(extras: list[str], trainer: str) -> ConfigError:
    known, owners = known_flags(trainer), flag_owners()
    problems: list[str] = []
    after_unknown = False
    for tok in extras:
        if tok.startswith("-") and not _NEGATIVE_NUMBER.match(tok):
            problems.append(explain_unknown(tok.split("=", 1)[0], trainer, known, owners))
            after_unknown = True
        elif not after_unknown:
            problems.append(f"unexpected value {tok!r} (not after any flag that takes it)")
    return ConfigError.collect(problems, header="unknown flags")


def parse_config(
    trainer: str,
    argv: list[str] | None = None,
    *,
    check: bool = True,
    world_size: int | None = None,
    device: str | None = None,
    translation: Translation | None = None,
):
    """Parse `argv` (default sys.argv[1:]) into the config dataclass of `trainer` ("sft" | "rm" | "dpo" |
    "ppo", or the reward server's "serve-rm").

    `--config run.yaml` supplies values underneath the command line. With check=True the config is
    validated (`validate(cfg, world_size, device)`, world_size from env WORLD_SIZE) and its warnings are
    issued as `ConfigWarning`s. Raises ConfigError for unknown flags (with the closest flag or the
    0.10.2 replacement of an old flag), bad values, bad YAML and failed validation. `-h` prints the
    help grouped by section and exits."""
    if trainer not in COMMAND_CONFIGS:
        raise ConfigError(f"unknown trainer {trainer!r}; valid: {', '.join(TRAINERS)}")
    cls = config_class(trainer)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(trainer)
    path = _config_path(argv)
    sources: dict[str, str] = {}
    trl_source = "TRL config"
    if path is not None:
        data = read_yaml(path)
        if is_trl_config(data):
            translation = _translate_trl(path, data, cls, parser, argv)
            trl_source = f"TRL config {path}"
        else:
            values = load_yaml_values(path, cls)
            parser.set_defaults(**values)
            sources.update(dict.fromkeys(values, f"--config {path}"))
    if translation is not None:
        problems: list[str] = []
        translated = typed_values(translation.values, cls, problems)
        parser.set_defaults(**translated)
        sources.update(dict.fromkeys(translated, trl_source))
        if problems:  # a value of a type the translation passes through (a path that is not a string)
            raise ConfigError.collect([f"TRL translation: {p}" for p in problems])
    ns, extras = parser.parse_known_args(argv)
    if extras:
        raise _unknown_error(extras, trainer)
    sources.update(dict.fromkeys(_given_on_command_line(parser, argv), "command line"))
    cfg = cls()
    for spec in flag_specs(cls):
        set_path(cfg, spec.path, copy.deepcopy(getattr(ns, spec.path)))
    cfg.flag_sources = {sp.path: sources[sp.path] for sp in flag_specs(cls) if sp.path in sources}
    if translation is not None:
        cfg.trl_translation = translation
    if check:
        from posttrain.config.validate import validate

        ws = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        for message in validate(cfg, world_size=ws, device=device):
            warnings.warn(message, ConfigWarning, stacklevel=2)
    return cfg


def _given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The dests (flag paths) that `argv` itself sets (a negation sets its flag's path)."""
    unset = object()
    probe = argparse.Namespace(**{a.dest: unset for a in parser._actions if a.dest != "help"})
    parser.parse_known_args(argv, namespace=probe)
    return [dest for dest, value in vars(probe).items() if value is not unset and dest != "config"]


def config_from_trl(trl_config: Any, argv: list[str] | None = None, *, world_size: int = 1,
                    check: bool = True):
    """posttrain's PPO config for a TRL config: TRL 1.x's GRPOConfig or RLOOConfig, or TRL <= 0.21's
    RLOOConfig (a dict of field names or the config object; `trl_grpo.translate_trl`); as
    `config_from_trl_rloo` otherwise."""
    return parse_config("ppo", list(argv or []), check=check,
                        translation=translate_trl(trl_config, world_size))


def config_from_trl_rloo(trl_config: Any, argv: list[str] | None = None, *, world_size: int = 1,
                         check: bool = True):
    """posttrain's PPO config for a TRL RLOO config (a dict of TRL field names or a `trl.RLOOConfig`)
    with TRL's semantics (`trl_rloo.translate_rloo`; `world_size` = TRL's processes); `argv` are
    posttrain flags on top (a reward, Ray placement). `translation_of(cfg)` is the field-by-field report."""
    return parse_config("ppo", list(argv or []), check=check,
                        translation=translate_rloo(trl_config, world_size))


def _translate_trl(path: str, data: dict, cls: type, parser, argv: list[str]):
    """The TRL file at `path` (RLOOConfig, or TRL 1.x's GRPOConfig / RLOOConfig) as posttrain values.
    TRL's batch sizes are per process: the world is the actor's ranks under Ray (--actor.num_nodes x
    --actor.num_gpus_per_node), else WORLD_SIZE."""
    if cls.trainer != "ppo":
        raise ConfigError(f"--config {path}: a TRL RLOOConfig / GRPOConfig file (keys such as rloo_k, "
                          f"num_generations) is for posttrain ppo, not posttrain {cls.trainer}")
    sections = {spec.path.split(".")[0] for spec in flag_specs(cls)}
    mixed = sorted(k for k in data if isinstance(k, str) and ("." in k or k in sections or k == "trainer"))
    if mixed:
        raise ConfigError(f"--config {path}: TRL config fields mixed with posttrain keys "
                          f"({', '.join(mixed)}); a TRL file holds TRL field names only: give posttrain "
                          "flags on the command line")
    ns, _ = parser.parse_known_args(argv)
    ranks = getattr(ns, "actor.num_nodes") * getattr(ns, "actor.num_gpus_per_node")
    world = ranks if ranks > 1 else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return translate_trl(data, world_size=world)
    except ConfigError as e:
        raise ConfigError(f"--config {path}: {e}", e.problems) from None


def load_config(path: str | os.PathLike, trainer: str | None = None, *, check: bool = False):
    """Load a YAML file written by `save_config` (trainer read from its `trainer:` key if not given)."""
    if trainer is None:
        trainer = read_yaml(path).get("trainer")
        if trainer not in TRAINERS:
            raise ConfigError(f"{path}: no valid 'trainer:' key ({', '.join(TRAINERS)}); pass trainer=")
    return parse_config(trainer, ["--config", str(path)], check=check)
