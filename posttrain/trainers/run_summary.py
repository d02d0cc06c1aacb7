"""The end of a run, for every trainer (SFT, RM, DPO, PPO): `finish_run` writes `summary.json` into the
run directory (--ckpt.output_dir) and prints one line.

summary.json: trainer, command (the command line as typed, and argv), versions (posttrain, torch,
transformers, python), posttrain_git (the commit of the posttrain checkout that ran, when it runs from a
git checkout; else null), steps, final_train_metrics (the last logged values of every non-eval metric),
final_eval_metrics (the last eval, {} without one), model (the folder holding the final model), timings
(started / ended as ISO times, setup_s, train_s, wall_s). Its presence marks the folder as a finished
run (`run_folders.finished_run`)."""
from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import posttrain
from posttrain.utils.log import info
from posttrain.utils.metrics import read_metrics

SUMMARY_FILE = "summary.json"
# the metrics the summary line shows when the run logged them (all of them are in summary.json)
LINE_METRICS = ("train/loss", "train/acc", "reward/mean", "policy/loss", "critic/loss", "kl/mean")


def posttrain_git() -> str | None:
    """The commit of the git checkout posttrain runs from (with "-dirty" when it has changes), or None."""
    root = Path(posttrain.__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head or None


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"posttrain": posttrain.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def _final(records: list[dict], eval_part: bool) -> dict:
    """The last logged value of each metric: the evaluations' (SFT/RM/DPO's `eval/*`, RL's `eval_<name>_*`),
    or every other one."""
    out: dict = {}
    for record in records:
        out.update({k: v for k, v in record.items()
                    if k not in ("step", "time") and k.startswith(("eval/", "eval_")) == eval_part})
    return out


def _shown(metrics: dict, keys) -> str:
    return ", ".join(f"{k.split('/', 1)[1] if k.startswith(('train/', 'eval/')) else k} {v:.4g}"
                     for k, v in metrics.items() if k in keys and isinstance(v, (int, float)))


def finish_run(trainer: str, output_dir: str | os.PathLike, started: float, began: float | None) -> dict:
    """Write summary.json into `output_dir` (atomically) from its metrics.jsonl and print the summary line;
    `started` / `began`: time.time() when the run started and when training began. Returns the summary."""
    out = Path(output_dir)
    metrics_file = out / "metrics.jsonl"
    records = read_metrics(metrics_file) if metrics_file.is_file() else []
    now = time.time()
    began = started if began is None else began
    summary = {
        "trainer": trainer,
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
        "argv": list(sys.argv),
        "versions": versions(),
        "posttrain_git": posttrain_git(),
        "steps": max((r.get("step", 0) for r in records), default=0),
        "final_train_metrics": _final(records, eval_part=False),
        "final_eval_metrics": _final(records, eval_part=True),
        "model": str(out.resolve()),
        "timings": {"started": datetime.fromtimestamp(started).isoformat(timespec="seconds"),
                    "ended": datetime.fromtimestamp(now).isoformat(timespec="seconds"),
                    "setup_s": round(began - started, 1), "train_s": round(now - began, 1),
                    "wall_s": round(now - started, 1)},
    }
    tmp = out / f".{SUMMARY_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / SUMMARY_FILE)
    train = _shown(summary["final_train_metrics"], LINE_METRICS)
    evals = _shown(summary["final_eval_metrics"], list(summary["final_eval_metrics"])[:4])
    parts = [f"{trainer} finished: {summary['steps']} steps in {summary['timings']['wall_s']:.0f}s"]
    parts += [f"train {train}"] if train else []
    parts += [f"eval {evals}"] if evals else []
    info("; ".join(parts) + f"; model in {out} (summary.json there)")
    return summary
