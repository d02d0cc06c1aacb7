"""README's first command, the demo (`posttrain demo`, shortened to `--quick` as `make demo-quick` runs it),
runs as written in a scratch folder that sees the repository's `examples/` and `posttrain/`, and every stage
did what the demo says (`check_demo`). A module of its own: the demo reads no run folder of README's other
commands, so it need not wait for them, nor run on the worker of the Ray and vLLM tests (tests/conftest.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_documented_commands as documented
from doc_commands import ROOT, Command, steps

DEMO = [c for c in steps("README.md") if isinstance(c, Command) and c.argv[0] == "demo"]


@pytest.mark.e2e
@pytest.mark.parametrize("cmd", DEMO, ids=lambda c: "demo")
def test_readme_demo_command_runs(cmd, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLOTS", "1")  # the suite's runs skip their charts (tests/conftest.py)
    cwd = tmp_path / "README"
    cwd.mkdir()
    for name in ("examples", "posttrain"):
        (cwd / name).symlink_to(ROOT / name)
    documented.run_command(cmd, cwd, None)
    check_demo(cwd / cmd.argv[cmd.argv.index("--output") + 1], capsys.readouterr().out)


def check_demo(out: Path, printed: str) -> None:
    """`posttrain demo --quick` ran every stage end to end into `out`: SFT learns the task and the
    demonstrator's habit, then DPO, the reward model + PPO, and GRPO each train from the SFT model through
    the real entry points, with their metrics, plots and the summary table; then the multi-turn calculator
    task (SFT on transcripts, multi-turn RL, the single-turn control) and the vision-language colour task."""
    from posttrain.cli import demo
    from posttrain.utils.metrics import read_metrics

    summary = json.loads((out / "summary.json").read_text())
    acc = summary["accuracy"]
    assert list(acc) == ["base (random init)", *demo.STAGES]
    assert acc["base (random init)"] < 0.1
    sft = read_metrics(out / "sft" / "metrics.jsonl")
    losses = [r["train/loss"] for r in sft if "train/loss" in r]
    assert losses[-1] < losses[0] / 4  # SFT learns
    assert acc["after SFT"] < 0.5  # ... the demonstrator's habit too: a rounded number is read last
    samples = [json.loads(line) for line in (out / "samples_final.jsonl").read_text().splitlines()]
    assert len(samples) == summary["held_out_prompts"]
    assert 0.5 < summary["rm_preference_accuracy"] <= 1.0  # the RM learned something from the pairs
    for stage in ("sft", "dpo", "rm"):
        assert (out / stage / "plots" / "train.png").exists(), stage
    for stage in ("rl", "ppo_rm"):
        assert (out / stage / "plots" / "reward.png").exists(), stage
        assert any("reward/mean" in r for r in read_metrics(out / stage / "metrics.jsonl")), stage
    assert any("critic/value_loss" in k for r in read_metrics(out / "ppo_rm" / "metrics.jsonl") for k in r)
    assert "held-out accuracy" in printed and all(stage in printed for stage in demo.STAGES)
    assert "preference acc" in printed
    # the multi-turn stage: SFT on transcripts, multi-turn RL with the tool, the single-turn control
    assert list(summary["agent_success"]) == list(demo.AGENT_STAGES)
    assert all(0.0 <= v <= 1.0 for v in summary["agent_success"].values())
    rl = [r for r in read_metrics(out / "agent_rl" / "metrics.jsonl") if "agent/turns_mean" in r]
    assert rl and all(r["agent/failed"] == 0 for r in rl)
    assert "held-out success on multiplication with a calculator tool" in printed
    # the vision-language stage: SFT, RL with the colour reward, the blank-image control (each ran)
    assert list(summary["vision_accuracy"]) == ["base (random init)", *demo.VISION_STAGES]
    assert all(0.0 <= v <= 1.0 for v in summary["vision_accuracy"].values())
    assert any("reward/mean" in r for r in read_metrics(out / "vision" / "rl" / "metrics.jsonl"))
    assert "the colour of a shape in an image" in printed
