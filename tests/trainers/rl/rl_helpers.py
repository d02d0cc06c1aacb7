"""Helpers shared by the RL tests."""
from posttrain.utils.metrics import read_metrics


def rewards_by_step(run_dir, start: int = 1) -> list[float]:
    return [r["reward/mean"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r
            and r["step"] >= start]
