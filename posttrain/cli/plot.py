"""`posttrain plot RUN_DIR [RUN_DIR ...] [--out DIR] [--smoothing W]`: PNG charts of runs' metrics.jsonl
(several runs: overlaid, one line per run, into --out)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> list:
    from posttrain.utils.plot import SMOOTHING, plot_runs

    p = argparse.ArgumentParser(prog="posttrain plot", description=__doc__)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="a run directory (holding metrics.jsonl) or the metrics.jsonl file; several are "
                        "overlaid")
    p.add_argument("--out", default=None,
                   help="where to write the PNGs (default RUN_DIR/plots; required for several runs)")
    p.add_argument("--smoothing", type=float, default=SMOOTHING,
                   help=f"EMA weight of the smoothed line over the faint raw points, in [0, 1); 0 = raw "
                        f"line only (default {SMOOTHING})")
    args = p.parse_args(argv)
    try:
        paths = plot_runs(args.run_dirs, args.out, args.smoothing)
    except (FileNotFoundError, ValueError) as e:
        print(f"posttrain plot: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()
