"""Rank-aware console messages: `info` prints on the main process, `rank_info` on every rank (prefixed
with the rank), `warn_once` never repeats."""
from __future__ import annotations

import os
import sys

_warned: set[str] = set()


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def info(msg: str) -> None:
    if is_main_process():
        print(f"[posttrain] {msg}", file=sys.stderr, flush=True)


def rank_info(msg: str) -> None:
    """Print on every process, as `[posttrain] [rank R] msg` (per-rank facts: what each rank holds)."""
    print(f"[posttrain] [rank {os.environ.get('RANK', '0')}] {msg}", file=sys.stderr, flush=True)


def warn_once(msg: str) -> None:
    """Print a warning the first time `msg` is seen in this process (main process only)."""
    if msg in _warned:
        return
    _warned.add(msg)
    if is_main_process():
        print(f"[posttrain] WARNING: {msg}", file=sys.stderr, flush=True)
