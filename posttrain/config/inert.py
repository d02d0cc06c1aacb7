"""Flags that have no effect in a run, reported once at start-up ("nothing silent").

Each flag declares its own facts (`opt(..., inert=Inert(...))`, `posttrain.config.facts`); `inert_rules`
lists those that apply to a config's trainer and `inert_flags` applies them to the flags the user set.
Call `inert_flags` before or after resolving hardware defaults: it reads what the user asked for, which
resolution records on the config. tests/unit/config/test_flag_coverage.py checks that every flag either
acts or declares when it does not."""

from __future__ import annotations

from typing import Any, NamedTuple

from posttrain.config.facts import Condition
from posttrain.config.flag_values import format_value
from posttrain.config.hardware import device_type, resolved_values
from posttrain.config.spec import changed_values, flag_specs, get_path
from posttrain.config.trainers import CommandConfig


class InertRule(NamedTuple):
    """`--path` set away from its default has no effect in this run when `when(value, cfg, device_type)`
    is true; `when=None`: it never has an effect in this version. `reason` is what start-up prints,
    followed by `when`'s answer when that is a string (the run-specific why)."""

    path: str
    reason: str
    when: Condition | None = None

    def explain(self, value: Any, cfg: CommandConfig, dev: str) -> str | None:
        """The reason the flag has no effect in this run, or None when it acts."""
        if self.when is None:
            answer: bool | str = True
        elif getattr(self.when, "on_section", 0):  # facts.in_section: the flag's own section (or one above)
            prefix = ".".join(self.path.split(".")[:-self.when.on_section])
            section = get_path(cfg, prefix) if prefix else cfg
            answer = self.when(value, section, dev, prefix + "." if prefix else "")
        else:
            answer = self.when(value, cfg, dev)
        if not answer:
            return None
        return self.reason + answer if isinstance(answer, str) else self.reason


def inert_rules(cfg: CommandConfig) -> list[InertRule]:
    """Every declared fact of `cfg`'s trainer's flags, in flag order; a flag's own facts come before those of
    its sections, and the first that applies is the one reported."""
    return [InertRule(spec.path, fact.reason, fact.when) for spec in flag_specs(type(cfg))
            for fact in spec.inert
            if fact.trainers is None or cfg.trainer in fact.trainers]


def inert_flags(cfg: CommandConfig, device: Any) -> list[str]:
    """`--flag value: reason` for every flag set away from its default that has no effect in this run
    (on `device`), once per flag, in --help order. Flags still parse everywhere; this only reports them."""
    dev = device_type(device)
    changed = changed_values(cfg)
    for path, (asked, _used, _why) in resolved_values(cfg).items():
        if asked is None:
            changed.pop(path, None)  # an auto default, not something the user set
        else:
            changed[path] = asked
    # default-True: --ds.no_x
    negations = {s.path: s.negation_flag for s in flag_specs(type(cfg)) if s.negation}
    found: dict[str, str] = {}
    for rule in inert_rules(cfg):
        if rule.path not in changed or rule.path in found:
            continue
        value = changed[rule.path]
        reason = rule.explain(value, cfg, dev)
        if reason is not None:
            shown = "" if isinstance(value, bool) else " " + format_value(value)
            flag = negations[rule.path] if value is False and rule.path in negations else "--" + rule.path
            found[rule.path] = f"{flag}{shown} has no effect here: {reason}"
    return list(found.values())
