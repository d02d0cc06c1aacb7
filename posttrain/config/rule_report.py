"""What a config validation collects: one line per problem, naming the flag (`RuleReport`), and a check
shared by several sections (`check_pair`)."""
from __future__ import annotations

from typing import Any

from posttrain.config.flag_values import format_value


class RuleReport:
    """The problems (one line each, naming the flag) and warnings a validation collects."""
    def __init__(self) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def bad(self, flag: str, value: Any, why: str) -> None:
        text = "" if value is None or isinstance(value, bool) else format_value(value)
        shown = f" {text}" if text else ""
        self.problems.append(f"--{flag}{shown}: {why}")

    def need(self, ok: bool, flag: str, value: Any, why: str) -> None:
        if not ok:
            self.bad(flag, value, why)


def check_pair(r: RuleReport, flag: str, pair: list[float] | None) -> None:
    if pair is not None and not pair[0] < pair[1]:
        r.bad(flag, pair, "needs low < high")
