"""`posttrain serve-rm` as a real subprocess on 127.0.0.1 serving a reward_func file; RemoteReward
against it (with and without a bearer token), bad requests, and the unreachable-server error once
the server is gone. All traffic stays on 127.0.0.1; servers are always terminated."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from rewards_http import free_port, in_thread_server

from posttrain.agents.rewards import RemoteReward, RewardError, make_reward_source
from posttrain.agents.rewards.python_func import PythonRewardFunction
from posttrain.agents.rewards.remote import TOKEN_ENV

FUNCS = Path(__file__).parent / "reward_funcs"
PROMPTS = ["Q: 2+3=", "Q: 4*4=", "Q: 9-1="]
QUERIES = [p + r for p, r in zip(PROMPTS, [" 5", " 15", " it is 8"])]
LABELS = ["5", "16", "8"]
HTTP = requests.Session()
HTTP.trust_env = False  # never through a proxy: all traffic stays on 127.0.0.1


def start_server(*flags, env_token=None):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if env_token:
        env[TOKEN_ENV] = env_token
    cmd = [sys.executable, "-m", "posttrain.cli.serve_rm", "--reward.remote_url", str(FUNCS / "plain_reward.py"),
           "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc, base, headers=None, limit_s=60):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve-rm exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if HTTP.get(base + "/health", headers=headers, timeout=1).status_code in (200, 401):
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"serve-rm did not answer /health within {limit_s}s")


def stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def servers():
    """Two servers started together: one open, one requiring the token "s3cret" (given by env)."""
    open_proc, open_url = start_server()
    tok_proc, tok_url = start_server(env_token="s3cret")
    try:
        wait_ready(open_proc, open_url)
        wait_ready(tok_proc, tok_url)
        yield {"open": (open_proc, open_url), "token": (tok_proc, tok_url)}
    finally:
        stop(open_proc)
        stop(tok_proc)


def test_remote_reward_matches_local_function(servers):
    _, base = servers["open"]
    remote = RemoteReward(base + "/get_reward", token=None, timeout=10)
    out = remote.score(QUERIES, PROMPTS, LABELS)
    local = PythonRewardFunction(FUNCS / "plain_reward.py").score(QUERIES, PROMPTS, LABELS)
    assert out.rewards.tolist() == local.rewards.tolist() == [1.0, 0.0, 1.0]
    assert out.extra_logs["response_chars"].tolist() == [2.0, 3.0, 8.0]
    assert out.skipped.tolist() == [False] * 3
    assert HTTP.get(base + "/health", timeout=5).json()["status"] == "ok"


def test_token_required(servers, monkeypatch):
    _, base = servers["token"]
    url = base + "/get_reward"
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RewardError, match=r"rejected the request \(HTTP 401: missing Authorization header.*"
                                          f"set {TOKEN_ENV} to the token"):
        RemoteReward(url).score(QUERIES, PROMPTS, LABELS)
    with pytest.raises(RewardError, match="HTTP 401: wrong bearer token"):
        RemoteReward(url, token="guess").score(QUERIES, PROMPTS, LABELS)
    assert RemoteReward(url, token="s3cret").score(QUERIES, PROMPTS, LABELS).rewards.tolist() == [1.0, 0.0, 1.0]
    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    assert make_reward_source(url).score(QUERIES, PROMPTS, LABELS).rewards.tolist() == [1.0, 0.0, 1.0]


def test_bad_requests_get_400_with_the_problem(servers):
    _, base = servers["open"]
    url = base + "/get_reward"
    r = HTTP.post(url, data="not json", timeout=5)
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = HTTP.post(url, json={"query": "one string"}, timeout=5)
    assert r.status_code == 400 and "'query' must be a list of strings" in r.json()["detail"]
    r = HTTP.post(url, json={"query": ["a", "b"], "prompts": ["a"]}, timeout=5)
    assert r.status_code == 400 and "'prompts' must be a list of 2 strings" in r.json()["detail"]
    # OpenRLHF's older clients send only "query": prompts default to "", labels to None
    r = HTTP.post(url, json={"query": ["x"], "labels": ["x"]}, timeout=5)
    assert r.status_code == 200 and json.loads(r.text)["rewards"] == [1.0]


class Raising:
    """A reward source whose reward_func is broken, for the 500 path."""

    def score(self, queries, prompts, labels=None, **kwargs):
        raise RewardError("reward function r.py raised KeyError: 'answer'")

    def close(self):
        pass


def test_source_error_is_500_retried_then_reported():
    with in_thread_server(Raising()) as base:
        r = HTTP.post(base + "/get_reward", json={"query": ["a"]}, timeout=5)
        assert r.status_code == 500 and r.json()["detail"] == "RewardError: reward function r.py raised KeyError: 'answer'"
        remote = RemoteReward(base + "/get_reward", retries=2, backoff=0.01, timeout=5)
        with pytest.raises(RewardError, match=r"failed after 2 attempts \(HTTP 500: RewardError: reward function r.py "
                                              r"raised KeyError: 'answer'\)"):
            remote.score(["a"], [""], None)


def test_skipped_samples_travel_over_http(tmp_path):
    path = tmp_path / "half_nan.py"
    path.write_text("def reward_func(queries, prompts, labels, **kw):\n"
                    "    return [float('nan') if q == 'bad' else 1.0 for q in queries]\n")
    with in_thread_server(PythonRewardFunction(path, on_error="skip")) as base:
        out = RemoteReward(base + "/get_reward").score(["ok", "bad", "ok"], ["", "", ""], None)
    assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.skipped.tolist() == [False, True, False]
    assert out.skip_reasons == [f"reward function {path}: reward 1 is NaN"]


def test_server_killed_gives_unreachable_error(servers):
    proc, base = start_server()
    try:
        wait_ready(proc, base)
        remote = RemoteReward(base + "/get_reward", timeout=2, retries=2, backoff=0.05)
        assert remote.score(QUERIES, PROMPTS, LABELS).rewards.tolist() == [1.0, 0.0, 1.0]
    finally:
        stop(proc)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=rf"reward server {base}/get_reward unreachable after 2 attempts "
                                          r"\(Connection refused\); start it with `posttrain serve-rm"):
        remote.score(QUERIES, PROMPTS, LABELS)
    assert time.monotonic() - t0 < 10  # bounded: 2 attempts, 0.05 s backoff


def test_serve_rm_cli_errors(capsys):
    from posttrain.cli.serve_rm import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--reward.remote_url", "f.py", "--reward.model_name_or_path", "m"])
    assert e.value.code == 2 and "exactly one of --reward.model_name_or_path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--reward_pretrain", "m"])
    assert "--reward_pretrain: renamed in OpenRLHF 0.10.2; use --reward.model_name_or_path" in capsys.readouterr().err
    args = parse_args(["--reward.model_name_or_path", "m", "--ds.value_head_prefix", "value_head",
                       "--reward.normalize_enable", "--token", "t"])
    assert (args.value_head_prefix, args.normalize, args.token, args.host, args.port) == (
        "value_head", True, "t", "127.0.0.1", 5000)
    missing = subprocess.run([sys.executable, "-m", "posttrain.cli.serve_rm", "--reward.remote_url",
                              "/nonexistent/r.py"], check=False, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "reward function file not found" in missing.stderr
