"""`posttrain demo --quick` (the main job's small variant) runs end to end: SFT measurably learns,
then the RL stage runs with the verifiable reward and draws its reward curve."""
import json

from posttrain.utils.metrics import read_metrics


def test_quick_demo_sft_raises_held_out_accuracy(tmp_path, capsys):
    from posttrain.cli import demo

    summary = demo.main(["--quick", "--output", str(tmp_path)])
    acc = summary["accuracy"]
    assert acc["base (random init)"] < 0.1
    assert acc["after SFT"] >= acc["base (random init)"] + 0.4, acc
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    rows = read_metrics(tmp_path / "sft" / "metrics.jsonl")
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert evals[-1] < evals[0] / 2  # held-out loss falls
    assert (tmp_path / "sft" / "plots" / "train.png").exists()
    assert (tmp_path / "rl" / "plots" / "reward.png").exists()
    rl = read_metrics(tmp_path / "rl" / "metrics.jsonl")
    assert len([r for r in rl if "reward/mean" in r]) == 5 and "after RL (GRPO)" in acc
    out = capsys.readouterr().out
    assert "after SFT" in out and "after RL (GRPO)" in out and "held-out accuracy" in out
