"""How `posttrain ppo` runs end (issue 46): SIGTERM to the whole process group of a Ray run (`timeout`),
which the local Ray's daemons, in process groups of their own, do not receive; a fresh start under
--ckpt.load_enable starts samples.jsonl over."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from posttrain.utils.checkpoint import verify_checkpoint
from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e

DEADLINE_S = 300  # a guard against a hung test, not a speed requirement


def _wait_for_checkpoint(proc: subprocess.Popen, ckpt, log) -> None:
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        if (ckpt / "global_step1").is_dir():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before its first checkpoint:\n"
                                 f"{log.read_text()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no checkpoint after {DEADLINE_S} s")


def ppo_flags(model, data, reward, out, *extra) -> list[str]:
    """A nano-model PPO run on the arithmetic prompts with a reward
    file (as tests/trainers/rl/conftest.py)."""
    return ["--actor.model_name_or_path", model, "--data.prompt_dataset", data, "--data.input_key", "prompt",
            "--data.label_key", "answer", "--data.apply_chat_template", "--data.max_len", "48",
            "--reward.remote_url", reward, "--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "4",
            "--rollout.max_new_tokens", "4", "--rollout.micro_batch_size", "16", "--train.batch_size", "32",
            "--train.micro_batch_size", "16", "--data.max_samples", "64", "--algo.kl.init_coef", "0",
            "--ckpt.output_dir", out, *extra]


@pytest.fixture
def zero_reward(tmp_path):
    path = tmp_path / "zero.py"
    path.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kwargs):\n"
                    "    return {'rewards': torch.zeros(len(queries))}\n")
    return path


def test_sigterm_to_the_process_group_of_a_ray_run_ends_like_sigterm_to_the_controller(
        tiny_model_dir, arithmetic_dir, zero_reward, tmp_path):
    """`kill -TERM -<pgid>` after the first checkpoint of a run that started its own local Ray (an actor rank
    and a rollout engine): Ray's daemons run in process groups of their own, so the signal reaches the
    controller alone; it writes `terminated at step N; last checkpoint: ...` (exit 143), stops that Ray,
    and no process of the run is left behind."""
    out = tmp_path / "run"
    flags = ppo_flags(tiny_model_dir, arithmetic_dir, zero_reward, out, "--vllm.num_engines", "1",
                      "--rollout.engine", "hf", "--algo.advantage.estimator", "group_norm",
                      "--train.num_episodes", "50", "--ckpt.save_steps", "1", "--ckpt.max_num", "2")
    log = tmp_path / "run.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "ppo", *map(str, flags)],
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True,
                                env={**os.environ, "RAY_ADDRESS": ""})
    try:
        _wait_for_checkpoint(proc, out / "checkpoints", log)
        started = psutil.Process(proc.pid).children(recursive=True)  # Ray's head, raylet, workers
        raylets = [p for p in started if "raylet" in " ".join(p.cmdline())]
        assert raylets, [p.cmdline()[:2] for p in started]
        assert all(os.getpgid(p.pid) != proc.pid for p in raylets)  # not in the group the signal goes to
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = log.read_text()
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("posttrain ppo: error:")]
    assert len(errors) == 1 and errors[0].startswith("posttrain ppo: error: terminated at step "), err[-3000:]
    last = errors[0].split("; last checkpoint: ")[1]
    assert verify_checkpoint(last) is None
    _, alive = psutil.wait_procs(started, timeout=30)
    assert alive == [], f"processes of the run left: {[p.cmdline()[:3] for p in alive]}"


def test_a_fresh_start_under_load_enable_starts_the_samples_file_over(tiny_model_dir, arithmetic_dir,
                                                                      zero_reward, tmp_path):
    """--ckpt.load_enable with no checkpoint to resume: the run starts fresh, and so do samples.jsonl and
    metrics.jsonl (rows an earlier run left there are not continued)."""
    out = tmp_path / "run"
    out.mkdir()
    old = '{"step": 1, "prompt": "an earlier run", "response": "", "reward": 0.0}\n'
    (out / "samples.jsonl").write_text(old * 3)
    (out / "metrics.jsonl").write_text('{"step": 1, "time": 0, "reward/mean": 5.0}\n')
    flags = ppo_flags(tiny_model_dir, arithmetic_dir, zero_reward, out, "--data.max_samples", "8",
                      "--train.num_episodes", "1", "--ckpt.load_enable")
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "ppo", *map(str, flags)], check=False,
                          capture_output=True, text=True, timeout=DEADLINE_S,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no valid checkpoint" in proc.stderr and "starting fresh" in proc.stderr
    samples = read_metrics(out / "samples.jsonl")
    assert samples and all(r["prompt"] != "an earlier run" for r in samples)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1]
