"""Errors and warnings of the config layer."""

from __future__ import annotations

import sys

from posttrain.utils.errors import ConfigError  # noqa: F401  (the config layer's error, defined at the floor for compat/)


class ConfigWarning(UserWarning):
    """A setting that is allowed but probably not what the user wants (e.g. bf16 on CPU)."""


def main_error_exit(e: ConfigError, prog: str = "posttrain") -> NoReturn:  # noqa: F821
    """Print `prog: error: <message>` to stderr and exit with status 2 (argparse's convention)."""
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(2)
