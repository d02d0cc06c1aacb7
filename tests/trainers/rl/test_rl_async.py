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
from rl_runs import ppo_flags

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.slow

ASYNC = ["--train.async_enable", "--algo.advantage.estimator", "group_norm", "--train.num_episodes", "1"]


def comparable(rows):
    """Every logged value except wall-clock timings, the async bookkeeping and the bytes synced (none where
    the engine shares the actor's module)."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("timing/", "async/", "sync/", "rollout/policy_versions"))
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


def test_partial_rollout_samples_span_the_weight_update_that_lands_mid_generation(run_ppo, monkeypatch):
    """Decode steps slowed down (generation >> training): the sync after step j lands while batch j+1
    is being generated; without the producer holding the lock it goes through between two decode
    steps, so samples span two versions (with the lock held, every sample would have one)."""
    from posttrain.rollout.decode_batch import DecodeBatch

    step = DecodeBatch.step
    monkeypatch.setattr(DecodeBatch, "step", lambda self: (time.sleep(0.25), step(self))[1])
    out, _ = run_ppo(*ASYNC, "--train.async_queue_size", "1", "--train.partial_rollout_enable",
                     "--data.max_samples", "32", name="partial")
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 4
    assert max(r["rollout/policy_versions_per_sample"] for r in rows) > 1.0
    assert all(r["async/staleness_max"] <= 1 for r in rows)  # never more than the queue behind


def test_a_resume_neither_replays_nor_skips_a_prompt(run_ppo, tmp_path):
    """Queue 2: at the step-2 checkpoint the producer has drawn prompts for later steps; the checkpoint
    keeps the cursor of step 2's batch, so the resumed run trains the prompts the uninterrupted one did.
    Five steps of 8 prompts: at step 2 the producer is still short of the data's end."""
    flags = [*ASYNC, "--train.async_queue_size", "2", "--ckpt.save_steps", "2", "--ckpt.max_num", "4",
             "--data.max_samples", "40"]
    full, _ = run_ppo(*flags, "--ckpt.path", tmp_path / "ck_full", name="full")
    import torch

    state = torch.load(tmp_path / "ck_full" / "global_step2" / "trainer_state.pt", weights_only=False)
    assert state["prompt_cursor"] == 2 * 8  # two batches of 8 prompts trained, whatever was queued
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck_full" / "global_step2", ck / "global_step2")
    resumed, _ = run_ppo(*flags, "--ckpt.path", ck, "--ckpt.load_enable", name="resumed")
    uninterrupted, again = first_prompts(full), first_prompts(resumed)
    assert sorted(again) == list(range(3, 6))  # steps 3..5, each trained once
    assert again == {s: p for s, p in uninterrupted.items() if s >= 3}


@pytest.mark.e2e
def test_ctrl_c_during_async_training_ends_cleanly(rl_setup, tmp_path):
    flags = ppo_flags(rl_setup, tmp_path / "run", *ASYNC, "--train.num_episodes", "30",
                      "--ckpt.save_steps", "2")
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


def test_evaluation_under_async_rl_covers_the_starting_model_and_the_last_step(run_ppo, rl_setup):
    """The baseline evaluation runs while the producer already generates the first batch (it waits for the
    generation lock); evaluations at steps 0, 2 and 3 (the last), and a best model when one beats step 0."""
    _, data, _ = rl_setup
    out, _ = run_ppo(*ASYNC, "--train.max_steps", "3", "--eval.dataset", data, "--eval.split", "test",
                     "--eval.steps", "2", "--eval.n_samples_per_prompt", "1", name="async_eval",
                     reward="rising.py")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval_data_pass1" in r] == [0, 2, 3]
    assert json.loads((out / "best" / "best_metric.json").read_text())["step"] == 3


@pytest.mark.parametrize("size", ["-1"])
def test_a_negative_queue_is_refused(run_ppo, size):
    from posttrain.config import ConfigError

    with pytest.raises((ConfigError, SystemExit)):
        run_ppo(*ASYNC, "--train.async_queue_size", size, name="neg")


def test_oversampling_buffers_groups_and_a_resume_regenerates_them(run_ppo, tmp_path):
    """--rollout.vllm_generate_batch_size 16 with batches of 8: one generation call every other step;
    the step-3 checkpoint keeps the cursor of its 8 trained groups (8 more sit in the buffer), so a run
    resumed there trains the same prompts as the uninterrupted one (6 steps of 8 prompts)."""
    import torch

    flags = [*ASYNC, "--rollout.vllm_generate_batch_size", "16", "--ckpt.save_steps", "1",
             "--ckpt.max_num", "8", "--data.max_samples", "48"]
    full, _ = run_ppo(*flags, "--ckpt.path", tmp_path / "ck_full", name="over")
    rows = read_metrics(full / "metrics.jsonl")
    assert [r["rollout/generation_calls"] for r in rows] == [1, 0] * 3
    assert [r["rollout/buffered_groups"] for r in rows] == [8, 0] * 3
    assert all(r["async/staleness_max"] <= 2 for r in rows)  # a buffered group waits one more step
    cursors = [torch.load(tmp_path / "ck_full" / f"global_step{s}" / "trainer_state.pt",
                          weights_only=False)["prompt_cursor"] for s in range(3, 7)]
    assert cursors == [24, 32, 40, 48]
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck_full" / "global_step3", ck / "global_step3")
    resumed, _ = run_ppo(*flags, "--ckpt.path", ck, "--ckpt.load_enable", name="over_resumed")
    again = first_prompts(resumed)
    assert sorted(again) == [4, 5, 6] and again == {s: p for s, p in first_prompts(full).items() if s >= 4}
