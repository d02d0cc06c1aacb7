import json
import math

import pytest

from posttrain.utils.metrics import MetricsLogger, read_metrics
from posttrain.utils.plot import plot_run


def test_jsonl_rows_and_plot(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    for step in range(1, 6):
        log.log(step, {"train/loss": 1.0 / step, "train/lr": 1e-3, "eval/acc": step / 10, "note": "x"})
    log.log(6, {"train/loss": math.nan})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[1]["train/loss"] == pytest.approx(0.5)
    assert rows[-1]["train/loss"] == "nan"  # non-finite values stay visible
    assert any((tmp_path / "tb").iterdir())
    pngs = plot_run(tmp_path)
    assert sorted(p.name for p in pngs) == ["eval.png", "train.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_resume_truncates_rows_after_checkpoint(tmp_path):
    log = MetricsLogger(tmp_path)
    for step in range(1, 5):
        log.log(step, {"loss": step})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # torn line from a crash
    resumed = MetricsLogger(tmp_path, resume=True)
    resumed.truncate_after(2)
    resumed.log(3, {"loss": 30})
    assert ([(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")]
            == [(1, 1), (2, 2), (3, 30)])


def test_plot_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0}) + "\n")
    with pytest.raises(ValueError, match="no numeric metrics"):
        plot_run(tmp_path)
