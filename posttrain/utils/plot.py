"""PNG charts of a run's metrics.jsonl: one chart per metric prefix group (`train/*`, `eval/*`, ...)."""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

from posttrain.utils.metrics import METRICS_FILE, read_metrics


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write `<out_dir>/<group>.png` (default out_dir: `<run_dir>/plots`) and return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE if run_dir.is_dir() else run_dir
    if not path.exists():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}: pass a run directory written by a posttrain trainer")
    rows = read_metrics(path)
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        for key, value in row.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series[key].append((row["step"], float(value)))
    if not series:
        raise ValueError(f"{path} holds no numeric metrics to plot")
    groups: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        groups[key.split("/", 1)[0] if "/" in key else "metrics"].append(key)
    out = Path(out_dir) if out_dir else path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for group, keys in groups.items():
        n = len(keys)
        cols = min(3, n)
        rows_n = (n + cols - 1) // cols
        fig, axes = plt.subplots(rows_n, cols, figsize=(4.5 * cols, 3.2 * rows_n), squeeze=False)
        for ax, key in zip(axes.flat, keys):
            steps, values = zip(*series[key])
            ax.plot(steps, values, marker="." if len(steps) < 50 else None)
            ax.set_title(key, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[n:]:
            ax.set_visible(False)
        fig.tight_layout()
        target = out / f"{group.replace('/', '_')}.png"
        fig.savefig(target, dpi=90)
        plt.close(fig)
        written.append(target)
    return written
