"""Errors and warnings of the config layer."""

from __future__ import annotations

import sys

from posttrain.utils.errors import UserError


class ConfigError(UserError, ValueError):
    """Bad flags, YAML or values. The message names the flag(s) and what is valid; `problems` lists
    every individual problem when several were found at once."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems else [message]

    @classmethod
    def collect(cls, problems: list[str], header: str = "invalid configuration") -> ConfigError:
        if len(problems) == 1:
            return cls(problems[0], problems)
        return cls(
            f"{header} ({len(problems)} problems):\n" + "\n".join(f"  - {p}" for p in problems), problems
        )


class ConfigWarning(UserWarning):
    """A setting that is allowed but probably not what the user wants (e.g. bf16 on CPU)."""


def main_error_exit(e: ConfigError, prog: str = "posttrain") -> NoReturn:  # noqa: F821
    """Print `prog: error: <message>` to stderr and exit with status 2 (argparse's convention)."""
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(2)
