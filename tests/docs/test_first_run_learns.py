"""The README's first run, as written (not shortened): RL from the SFT model visibly learns, i.e. the greedy
held-out accuracy that `--eval.dataset` logs at step 0 rises by a wide margin by the last step.
About 7 minutes on 2 cores: `make test-long` runs it (POSTTRAIN_LONG_TESTS=1); `make test` runs the same
commands shortened (test_documented_commands.py)."""
from __future__ import annotations

import os

import pytest
from doc_commands import ROOT, Command, steps

from posttrain.utils.metrics import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("POSTTRAIN_LONG_TESTS") != "1",
                                 reason="the README's first run in full (~7 min): make test-long")]


def _readme_command(name: str, output: str) -> Command:
    """The README command `posttrain <name>` that writes the run folder `output`."""
    return next(s for s in steps("README.md") if isinstance(s, Command) and s.argv[0] == name
                and output in s.argv)


def test_readme_first_rl_run_raises_held_out_accuracy(tmp_path):
    from posttrain.cli.main import main

    for name in ("examples", "posttrain"):
        (tmp_path / name).symlink_to(ROOT / name)
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        for name, output in (("init-tiny", "runs/tiny"), ("sft", "runs/sft"), ("ppo", "runs/rl")):
            try:
                main(list(_readme_command(name, output).argv))
            except SystemExit as e:
                assert e.code in (0, None), f"posttrain {name}: exit {e.code}"
    finally:
        os.chdir(old)
    evals = [r for r in read_metrics(tmp_path / "runs" / "rl" / "metrics.jsonl") if "eval_prompts_pass1" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] > 0
    # exact answers on held-out prompts: the SFT model appends its rounded estimate, RL drops it
    assert first["eval_prompts_pass1"] < 0.3
    assert last["eval_prompts_pass1"] >= max(0.5, first["eval_prompts_pass1"] + 0.3), evals
