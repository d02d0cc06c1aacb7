"""Async RL (`--train.async_enable`, trainers/rl/async_pipeline.py) end to end in one process: the
producer generates ahead of training, staleness is bounded and logged, a fixed-seed run is
reproducible, queue 0 is the synchronous trainer, partial rollout records the versions, and a
checkpoint keeps the cursor of the last batch trained (a resume neither replays nor skips prompts)."""
import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from posttrain.utils.metrics import read_metrics

ASYNC = ["--train.async_enable", "--algo.advantage.estimator", "group_norm", "--train.num_episodes", "1"]


def comparable(rows):
    """Every logged value except wall-clock timings and the async bookkeeping."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "async/", "rollout/policy_versions"))
             and k not in ("time", "elapsed")} for r in rows]


def first_prompts(run_dir):
    """The first prompt of each step, as samples.jsonl recorded it."""
    seen = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        seen.setdefault(row["step"], row["prompt"])
    return seen


def test_queue_of_one_bounds_staleness_and_is_reproducible(run_ppo):
    a, _ = run_ppo(*ASYNC, "--train.async_queue_size", "1", name="q1")
    b, _ = run_ppo(*ASYNC, "--train.async_queue_size", "1", name="q1_again")
    rows = read_metrics(a / "metrics.jsonl")
    assert len(rows) == 8
    assert rows[0]["async/staleness_max"] == 0  # the first batch: the initial weights
    assert [r["async/staleness_max"] for r in rows[1:]] == [1.0] * 7  # one version behind, never more
    assert all(r["rollout/policy_versions_per_sample"] == 1.0 for r in rows)
    assert all("async/queue_wait" in r and "timing/generation" in r for r in rows)
    assert comparable(rows) == comparable(read_metrics(b / "metrics.jsonl"))
    r = [row["reward/mean"] for row in rows]
    assert sum(r[-2:]) / 2 > sum(r[:2]) / 2 + 0.15, r  # it still learns, one step stale


def test_queue_of_zero_is_the_synchronous_trainer(run_ppo):
    sync, _ = run_ppo("--algo.advantage.estimator", "group_norm", "--train.num_episodes", "1", name="sync")
    q0, _ = run_ppo(*ASYNC, "--train.async_queue_size", "0", name="q0")
    rows = read_metrics(q0 / "metrics.jsonl")
    assert all(r["async/staleness_max"] == 0 for r in rows)
    assert comparable(rows) == comparable(read_metrics(sync / "metrics.jsonl"))
    assert (sync / "samples.jsonl").read_text() == (q0 / "samples.jsonl").read_text()


def test_partial_rollout_runs_and_logs_the_versions_per_sample(run_ppo):
    out, _ = run_ppo(*ASYNC, "--train.async_queue_size", "2", "--train.partial_rollout_enable", name="partial")
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 8
    assert all(1.0 <= r["rollout/policy_versions_per_sample"] and r["async/staleness_max"] <= 2 for r in rows)


def test_a_resume_neither_replays_nor_skips_a_prompt(run_ppo, tmp_path):
    """Queue 2: at the step-2 checkpoint the producer has drawn prompts for later steps; the checkpoint
    keeps the cursor of step 2's batch, so the resumed run trains the prompts the uninterrupted one did."""
    flags = [*ASYNC, "--train.async_queue_size", "2", "--ckpt.save_steps", "2", "--ckpt.max_num", "4"]
    full, _ = run_ppo(*flags, "--ckpt.path", tmp_path / "ck_full", name="full")
    import torch

    state = torch.load(tmp_path / "ck_full" / "global_step2" / "trainer_state.pt", weights_only=False)
    assert state["prompt_cursor"] == 2 * 8  # two batches of 8 prompts trained, whatever was queued
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck_full" / "global_step2", ck / "global_step2")
    resumed, _ = run_ppo(*flags, "--ckpt.path", ck, "--ckpt.load_enable", name="resumed")
    uninterrupted, again = first_prompts(full), first_prompts(resumed)
    assert sorted(again) == list(range(3, 9))  # steps 3..8, each trained once
    assert again == {s: p for s, p in uninterrupted.items() if s >= 3}


def test_ctrl_c_during_async_training_ends_cleanly(rl_setup, tmp_path):
    from conftest import ppo_flags

    flags = ppo_flags(rl_setup, tmp_path / "run", *ASYNC, "--train.num_episodes", "30", "--ckpt.save_steps", "2")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.train_ppo_ray", *map(str, flags)],
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "saved checkpoint" in line:
            break
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    err = "".join(seen) + rest
    assert proc.returncode == 2, err[-3000:]
    lines = [x for x in err.splitlines() if "error: interrupted" in x]
    assert len(lines) == 1 and "last checkpoint" in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("size", ["-1"])
def test_a_negative_queue_is_refused(run_ppo, size):
    from posttrain.config import ConfigError

    with pytest.raises((ConfigError, SystemExit)):
        run_ppo(*ASYNC, "--train.async_queue_size", size, name="neg")
