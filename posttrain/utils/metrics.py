"""Metric sinks. The JSONL file `<run_dir>/metrics.jsonl` is always written (one object per
logged step: {"step": int, "time": unix seconds, <name>: float, ...}); TensorBoard and W&B are
added when asked for. Only the main process writes."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from posttrain.utils.extras import require

METRICS_FILE = "metrics.jsonl"


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of dropping them
    return value


class MetricsLogger:
    def __init__(self, run_dir: str | os.PathLike, *, tensorboard_dir: str | None = None,
                 wandb: dict | None = None, config: dict | None = None, enabled: bool = True,
                 resume: bool = False) -> None:
        """`wandb` holds {key, org, group, project, run_name}; key None disables W&B."""
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        if wandb and wandb.get("key"):
            self._wandb = _start_wandb(wandb, config)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: _plain(v) for k, v in metrics.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def truncate_after(self, step: int) -> None:
        """On resume, drop rows logged after the checkpoint's step so the curve has no duplicates; in
        TensorBoard, the events an earlier writer logged after `step` are purged (`purge_step`)."""
        if not self.enabled:
            return
        truncate_jsonl_after(self.path, step)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            log_dir = self._tb.log_dir
            self._tb.close()
            self._tb = SummaryWriter(log_dir=log_dir, purge_step=step + 1)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(cfg: dict, config: dict | None):
    require("--logger.wandb.key", "wandb")
    import wandb

    key = cfg.get("key")
    if key and str(key) != "True":
        wandb.login(key=str(key))
    return wandb.init(entity=cfg.get("org"), project=cfg.get("project"), group=cfg.get("group"),
                      name=cfg.get("run_name"), config=config, reinit=True)


def truncate_jsonl_after(path: str | os.PathLike, step: int) -> None:
    """Keep only the rows of a JSONL log (metrics.jsonl, samples.jsonl) whose "step" is <= `step`
    (resume: the steps after the checkpoint are logged again); a missing file is left alone."""
    path = Path(path)
    if not path.exists():
        return
    rows = read_metrics(path)
    with path.open("w") as f:
        for row in rows:
            if row.get("step", 0) <= step:
                f.write(json.dumps(row) + "\n")


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics.jsonl file; a torn last line (crash mid-write) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
