"""PNG charts of runs' metrics.jsonl: one figure per metric group (`train/*`, `eval/*`, ...; names without a
`/` go to `metrics`), at most `PER_FIGURE` charts in it (a larger group continues in `<group>_2.png`, ...).

Each figure is titled with the run name (config.yaml's `logger.wandb.run_name` when set, else the run
folder's name). Each chart draws the raw points faint and an exponential moving average over them
(`s_0 = x_0`, `s_i = w * s_{i-1} + (1 - w) * x_i`, weight `w` = `smoothing`, 0 draws the raw line only);
a series of fewer than `MIN_SMOOTHED` points is drawn as it is, with markers, and one point is a marker
labelled with its value; a metric no run has a number for is left out.
Several runs are overlaid: one colour per run, the legend names the runs."""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.utils.metrics import METRICS_FILE, read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SMOOTHING = 0.6  # TensorBoard's default weight
MIN_SMOOTHED = 10  # a series of fewer points (evaluations, short runs) is drawn raw, with markers
PER_FIGURE = 6  # charts per figure: 2 columns x 3 rows at most
_COLS = 2

Series = list[tuple[int, float]]


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average starting at the first value (no pull towards 0)."""
    out: list[float] = []
    for v in values:
        out.append(v if not out else weight * out[-1] + (1 - weight) * v)
    return out


def _metrics_file(run: str | os.PathLike) -> Path:
    return Path(run) / METRICS_FILE if Path(run).is_dir() else Path(run)


def run_name(run_dir: Path) -> str:
    """config.yaml's `logger.wandb.run_name` when the run set one, else the run folder's name."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
        name = cfg["logger"]["wandb"]["run_name"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        name = None
    return str(name) if name else run_dir.resolve().name


def read_series(path: Path) -> dict[str, Series]:
    """{metric: [(step, value), ...]} of the numeric values in a metrics.jsonl ("nan" strings are skipped)."""
    series: dict[str, Series] = defaultdict(list)
    for row in read_metrics(path):
        for key, value in row.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series[key].append((row["step"], float(value)))
    return dict(series)


def plot_runs(runs: Sequence[str | os.PathLike], out_dir: str | os.PathLike | None = None,
              smoothing: float = SMOOTHING) -> list[Path]:
    """Write the charts of `runs` (run folders or metrics.jsonl files) to `out_dir` and return the PNG paths.

    `out_dir` defaults to `<run>/plots` for one run and is required for several. Raises FileNotFoundError
    naming every run without a metrics.jsonl, ValueError when nothing is numeric or an argument is wrong."""
    if out_dir is None and len(runs) > 1:
        raise ValueError("several runs are overlaid into one folder: give --out DIR")
    figures = charts(runs, smoothing)
    out = Path(out_dir) if out_dir is not None else _metrics_file(runs[0]).parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, fig in figures:
        # zlib level 1: ~1.5x faster than the default 6, files ~1.3x larger
        fig.savefig(out / f"{stem}.png", dpi=100, pil_kwargs={"compress_level": 1})
        written.append(out / f"{stem}.png")
    return written


def charts(runs: Sequence[str | os.PathLike], smoothing: float = SMOOTHING) -> list[tuple[str, Figure]]:
    """[(file stem, matplotlib Figure), ...] of `runs`, as `plot_runs` writes them (same errors)."""
    from matplotlib import rcParams
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    if not 0 <= smoothing < 1:
        raise ValueError(f"--smoothing {smoothing}: the EMA weight must be in [0, 1) (0 = no smoothing)")
    files = [_metrics_file(r) for r in runs]
    missing = [str(r) for r, f in zip(runs, files) if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"no {METRICS_FILE} in {', '.join(missing)}: pass run directories written "
                                "by a posttrain trainer")
    names = [run_name(f.parent) for f in files]
    if len(set(names)) < len(names):  # two folders of the same name: their paths tell them apart
        names = [str(f.parent) for f in files]
    data = [read_series(f) for f in files]
    keys = sorted(set().union(*data))
    if not keys:
        raise ValueError(f"{', '.join(map(str, files))} hold(s) no numeric metrics to plot")
    groups: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        groups[key.split("/", 1)[0] if "/" in key else "metrics"].append(key)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    title = " vs ".join(names)
    figures = []
    for group, group_keys in groups.items():
        for part in range(0, len(group_keys), PER_FIGURE):
            chunk = group_keys[part:part + PER_FIGURE]
            cols = min(_COLS, len(chunk))
            rows = -(-len(chunk) // cols)
            if len(names) > 1:  # the legend of the runs is placed by the layout engine
                fig = Figure(figsize=(6.4 * cols, 4.0 * rows), layout="constrained")
                axes = fig.subplots(rows, cols, squeeze=False)
            else:
                fig = Figure(figsize=(6.4 * cols, 4.0 * rows))
                axes = fig.subplots(rows, cols, squeeze=False, gridspec_kw=_fixed_margins(cols, rows))
            for ax, key in zip(axes.flat, chunk):
                for i, (name, series) in enumerate(zip(names, data)):
                    if key in series:
                        _draw(ax, series[key], colors[i % len(colors)], name, smoothing)
                ax.set_title(key, fontsize=11)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
            for ax in list(axes.flat)[len(chunk):]:
                ax.set_visible(False)
            fig.suptitle(f"{title}: {group}", fontsize=13)
            if len(names) > 1:
                handles = [Line2D([], [], color=colors[i % len(colors)], lw=2) for i in range(len(names))]
                fig.legend(handles, names, loc="outside upper right", fontsize=10)
            figures.append((group if part == 0 else f"{group}_{part // PER_FIGURE + 1}", fig))
    return figures


def _fixed_margins(cols: int, rows: int) -> dict[str, float]:
    """GridSpec margins from fixed inches, for one run's charts (what every run writes when it ends): a layout
    engine measures every label at each save, most of the time spent writing them. Room for the title above,
    tick labels on the left, the x label below, each chart's title and x label between rows."""
    width, height = 6.4 * cols, 4.0 * rows
    left, right, bottom, top, col_gap, row_gap = 0.9, 0.25, 0.55, 0.6, 0.9, 0.8
    axis_w = (width - left - right - (cols - 1) * col_gap) / cols
    axis_h = (height - top - bottom - (rows - 1) * row_gap) / rows
    return dict(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                wspace=col_gap / axis_w, hspace=row_gap / axis_h)


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """One run's charts (default `<run_dir>/plots`): `plot_runs([run_dir], out_dir)`."""
    return plot_runs([run_dir], out_dir)


def _draw(ax, series: Series, color: str, name: str, smoothing: float) -> None:
    """One run's series on `ax`: a labelled marker for one point, a few points as they are, else raw
    (faint) plus its EMA."""
    steps, values = zip(*series)
    if len(values) == 1:
        ax.plot(steps, values, "o", color=color, label=name)
        ax.annotate(f"{values[0]:.4g}", (steps[0], values[0]), textcoords="offset points", xytext=(6, 6))
        return
    if smoothing == 0 or len(values) < MIN_SMOOTHED:
        ax.plot(steps, values, color=color, lw=1.5, marker="." if len(values) < 50 else None, label=name)
        return
    ax.plot(steps, values, color=color, alpha=0.25, lw=1, label=f"{name} (raw)")
    ax.plot(steps, ema(values, smoothing), color=color, lw=2, label=name)
