"""`posttrain demo --quick` (the main job's small variant) runs every stage end to end: SFT learns
the task and the demonstrator's habit, then DPO, the reward model + PPO, and GRPO each train from the
SFT model through the real entry points, with their metrics, plots and the summary table; then the
multi-turn calculator task (SFT on transcripts, multi-turn RL, the single-turn control)."""
import json

import pytest

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e


def test_quick_demo_runs_every_stage(tmp_path, capsys):
    from posttrain.cli import demo

    summary = demo.main(["--quick", "--output", str(tmp_path)])
    acc = summary["accuracy"]
    assert list(acc) == ["base (random init)", *demo.STAGES]
    assert acc["base (random init)"] < 0.1
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    sft = read_metrics(tmp_path / "sft" / "metrics.jsonl")
    losses = [r["train/loss"] for r in sft if "train/loss" in r]
    assert losses[-1] < losses[0] / 4  # SFT learns
    assert acc["after SFT"] < 0.5  # ... the demonstrator's habit too: a rounded number is read last
    samples = [json.loads(line) for line in (tmp_path / "samples_final.jsonl").read_text().splitlines()]
    assert len(samples) == summary["held_out_prompts"]
    assert 0.5 < summary["rm_preference_accuracy"] <= 1.0  # the RM learned something from the pairs
    for stage in ("sft", "dpo", "rm"):
        assert (tmp_path / stage / "plots" / "train.png").exists(), stage
    for stage in ("rl", "ppo_rm"):
        assert (tmp_path / stage / "plots" / "reward.png").exists(), stage
        assert any("reward/mean" in r for r in read_metrics(tmp_path / stage / "metrics.jsonl")), stage
    assert any("critic/value_loss" in k for r in read_metrics(tmp_path / "ppo_rm" / "metrics.jsonl") for k in r)
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and all(stage in out for stage in demo.STAGES)
    assert "preference acc" in out
    # the multi-turn stage: SFT on transcripts, multi-turn RL with the tool, the single-turn control
    assert list(summary["agent_success"]) == list(demo.AGENT_STAGES)
    assert all(0.0 <= v <= 1.0 for v in summary["agent_success"].values())
    rl = [r for r in read_metrics(tmp_path / "agent_rl" / "metrics.jsonl") if "agent/turns_mean" in r]
    assert rl and all(r["agent/failed"] == 0 for r in rl)
    assert "held-out success on multiplication with a calculator tool" in out
    # the vision-language stage: SFT, RL with the colour reward, the blank-image control (each ran and was scored)
    assert list(summary["vision_accuracy"]) == ["base (random init)", *demo.VISION_STAGES]
    assert all(0.0 <= v <= 1.0 for v in summary["vision_accuracy"].values())
    assert any("reward/mean" in r for r in read_metrics(tmp_path / "vision" / "rl" / "metrics.jsonl"))
    assert "the colour of a shape in an image" in out
