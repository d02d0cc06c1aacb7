"""Reward sources inside `posttrain ppo`: a real serve-rm on 127.0.0.1, and every way a reward can
fail — each stops with a clear error (or a counted skip when asked) and never harms a checkpoint."""
import re
import subprocess
import sys
import time

import pytest
import requests
from rewards_http import free_port, in_thread_server
from rl_helpers import rewards_by_step

from posttrain.utils.checkpoint import CheckpointManager
from posttrain.utils.metrics import read_metrics


@pytest.fixture
def reward_server(rl_setup):
    _, _, rewards = rl_setup
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "serve-rm", "--reward.remote_url",
                             str(rewards / "correct.py"), "--port", str(port), "--token", "s3cret"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/health", headers={"Authorization": "Bearer s3cret"}, timeout=1).ok:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "serve-rm did not start"
            time.sleep(0.2)
        yield f"{url}/get_reward"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_remote_reward_server_drives_training(run_ppo, reward_server, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_RM_TOKEN", "s3cret")
    out, _ = run_ppo("--reward.remote_url", reward_server, "--algo.advantage.estimator", "group_norm",
                     "--train.num_episodes", "1", name="remote")
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 8 and "reward/accuracy" in rows[0]  # extra_logs came over HTTP


class _Counting:
    """A reward source that counts the queries it scores, then scores them with `inner`."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def score(self, queries, prompts, labels=None, **kwargs):
        self.seen.append(len(queries))
        return self.inner.score(queries, prompts, labels)

    def close(self):
        self.inner.close()


def test_two_reward_servers_share_each_batch(run_ppo, rl_setup):
    from posttrain.rewards import PythonRewardFunction

    _, _, rewards = rl_setup
    first, second = (_Counting(PythonRewardFunction(rewards / "correct.py")) for _ in range(2))
    with in_thread_server(first) as a, in_thread_server(second) as b:
        out, _ = run_ppo("--reward.remote_url", f"{a}/get_reward,{b}/get_reward", "--train.max_steps", "1",
                         name="two-servers")
    assert first.seen == [16] and second.seen == [16]  # 8 prompts x 4 samples, split in two
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 1 and "reward/accuracy" in rows[0]  # extra_logs joined over both servers


def user_error(capsys, run, *args, **kwargs) -> str:
    """Run `posttrain ppo` in-process; it must end like a user error: exit 2 and one
    `posttrain ppo: error:` message (returned)."""
    with pytest.raises(SystemExit) as exit_info:
        run(*args, **kwargs)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    err = err[err.index("posttrain ppo: error:"):]
    assert "Traceback (most recent call last)" not in err and "/posttrain/" not in err  # no frames of ours
    return err


def test_unreachable_server_is_a_clear_error(run_ppo, capsys):
    url = f"http://127.0.0.1:{free_port()}/get_reward"
    err = user_error(capsys, run_ppo, "--reward.remote_url", url, "--reward.retries", "2",
                     "--reward.timeout", "1", name="down")
    assert "unreachable after 2 attempts" in err


@pytest.mark.parametrize("reward,message", [("wrong_length.py", "7 rewards for 8|for 32"), ("nan.py", "NaN")])
def test_bad_reward_values_are_clear_errors(run_ppo, capsys, reward, message):
    err = user_error(capsys, run_ppo, reward=reward, name=reward)
    assert re.search(message, err) and reward in err


def test_reward_failure_mid_run_keeps_checkpoints(run_ppo, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_FAIL_AFTER", "3")
    ckpt = tmp_path / "ck"
    err = user_error(capsys, run_ppo, "--ckpt.path", ckpt, "--ckpt.save_steps", "2",
                     "--train.num_episodes", "1", reward="raises_late.py", name="crash")
    assert "ZeroDivisionError: the grader divided by zero" in err
    valid = CheckpointManager(ckpt).valid_checkpoints()
    assert [s for s, _ in valid] == [2]


@pytest.mark.slow
def test_skip_errors_counts_skipped_samples(run_ppo, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_TEST_FAIL_AFTER", "2")
    out, _ = run_ppo("--reward.skip_errors_enable", "--train.num_episodes", "1", "--data.max_samples", "24",
                     reward="raises_late.py", name="skip")  # 3 steps: the third one's grader raises
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["reward/skipped"] for r in rows[:3]] == [0, 0, 32]
    assert rewards_by_step(out)[2] == 0.0
