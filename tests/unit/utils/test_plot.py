"""`posttrain plot`'s charts, read back through the matplotlib Figures and the written files (no pixels)."""
import json

import pytest

from posttrain.cli.plot import main as plot_cli
from posttrain.utils.plot import MIN_SMOOTHED, PER_FIGURE, charts, ema, plot_runs


def write_run(folder, rows, run_name=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if run_name is not None:
        (folder / "config.yaml").write_text(f"trainer: sft\nlogger:\n  wandb:\n    run_name: {run_name}\n")
    return folder


def by_title(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_ema_starts_at_the_first_value():
    assert ema([1.0, 3.0, 3.0], 0.5) == [1.0, 2.0, 2.5]
    assert ema([4.0, 0.0], 0.0) == [4.0, 0.0]


def test_one_run_titled_smoothed_single_points_marked_empty_metrics_skipped(tmp_path):
    steps = range(1, MIN_SMOOTHED + 1)
    rows = [{"step": s, "time": 0, "train/loss": 2.0 / s, "train/gone": "nan"} for s in steps]
    rows.append({"step": MIN_SMOOTHED, "time": 0, "eval/acc": 0.75})
    run = write_run(tmp_path / "my-sft", rows)
    figs = dict(charts([run]))
    assert sorted(figs) == ["eval", "train"]
    train, evaluation = figs["train"], figs["eval"]
    assert train._suptitle.get_text() == "my-sft: train"
    assert list(by_title(train)) == ["train/loss"]  # "train/gone" has no number: no empty axis for it
    (loss,) = by_title(train).values()
    raw, smooth = loss.get_lines()
    assert raw.get_alpha() < 0.5 and smooth.get_alpha() in (None, 1)  # raw faint under the EMA line
    assert list(raw.get_ydata()) == [2.0 / s for s in steps]
    assert list(smooth.get_ydata()) == pytest.approx(ema([2.0 / s for s in steps], 0.6))
    (acc,) = by_title(evaluation).values()
    (point,) = acc.get_lines()
    assert point.get_marker() == "o" and list(point.get_ydata()) == [0.75]
    assert "0.75" in [t.get_text() for t in acc.texts]  # the value is written beside it
    assert len(charts([run], smoothing=0)[1][1].axes[0].get_lines()) == 1  # 0: raw line only


def test_run_name_from_config_and_large_groups_split(tmp_path):
    keys = [f"train/m{i}" for i in range(PER_FIGURE + 1)]
    rows = [{"step": s, **{k: s for k in keys}} for s in (1, 2)]
    run = write_run(tmp_path / "out", rows, run_name="lr-sweep-3")
    figs = charts([run])
    assert [stem for stem, _ in figs] == ["train", "train_2"]
    assert [len(by_title(f)) for _, f in figs] == [PER_FIGURE, 1]
    assert all(f._suptitle.get_text().startswith("lr-sweep-3: ") for _, f in figs)
    assert figs[0][1].get_size_inches()[0] >= 12  # readable: two wide columns, not a row of tiny subplots


def test_overlay_one_line_per_run_with_a_legend(tmp_path):
    a = write_run(tmp_path / "a", [{"step": s, "train/loss": 1 / s, "eval/acc": 0.5} for s in (1, 2, 3)])
    b = write_run(tmp_path / "b", [{"step": s, "train/loss": 2 / s} for s in (1, 2, 3, 4)])
    figs = dict(charts([a, b], smoothing=0))
    train = figs["train"]
    assert train._suptitle.get_text() == "a vs b: train"
    (loss,) = by_title(train).values()
    assert [line.get_label() for line in loss.get_lines()] == ["a", "b"]
    assert [t.get_text() for t in train.legends[0].get_texts()] == ["a", "b"]
    (acc,) = by_title(figs["eval"]).values()
    assert len(acc.get_lines()) == 1  # only run a logged eval/acc
    assert len(dict(charts([a, b]))["train"].axes[0].get_lines()) == 2  # 3 and 4 points: not smoothed
    steps = range(1, MIN_SMOOTHED + 1)
    long_a = write_run(tmp_path / "long-a", [{"step": s, "train/loss": 1 / s} for s in steps])
    long_b = write_run(tmp_path / "long-b", [{"step": s, "train/loss": 2} for s in steps])
    assert len(dict(charts([long_a, long_b]))["train"].axes[0].get_lines()) == 4  # raw + EMA per run


def test_files_and_cli_errors(tmp_path, capsys):
    a = write_run(tmp_path / "a", [{"step": s, "train/loss": 1 / s} for s in (1, 2)])
    b = write_run(tmp_path / "b", [{"step": s, "train/loss": 2 / s} for s in (1, 2)])
    paths = plot_cli([str(a), str(b), "--out", str(tmp_path / "cmp")])
    assert [p.name for p in paths] == ["train.png"] and paths[0].read_bytes()[:4] == b"\x89PNG"
    assert plot_runs([a])[0] == a / "plots" / "train.png"
    for argv, message in [([str(a), str(b)], "give --out DIR"),
                          ([str(a), "--smoothing", "1"], "--smoothing 1.0"),
                          ([str(tmp_path / "x"), str(tmp_path / "y"), "--out", str(tmp_path / "c")], "x, ")]:
        with pytest.raises(SystemExit) as e:
            plot_cli(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
