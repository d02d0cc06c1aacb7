"""Turn the clear errors raised below the CLI into one `posttrain: error:` line and exit code 2."""
from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def user_errors(prog: str):
    from posttrain.config import ConfigError
    from posttrain.data import DataError

    try:
        yield
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
