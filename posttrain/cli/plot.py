"""`posttrain plot RUN_DIR [--out DIR]`: PNG charts of a run's metrics.jsonl."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> list:
    from posttrain.utils.plot import plot_run

    p = argparse.ArgumentParser(prog="posttrain plot", description=__doc__)
    p.add_argument("run_dir", help="a run directory (holding metrics.jsonl) or the metrics.jsonl file")
    p.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/plots)")
    args = p.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"posttrain plot: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()
