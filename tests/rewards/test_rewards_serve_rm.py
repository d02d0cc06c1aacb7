"""`posttrain serve-rm` as a real subprocess on 127.0.0.1 serving a reward_func file; RemoteReward
against it (with and without a bearer token), bad requests, and the unreachable-server error once
the server is gone. All traffic stays on 127.0.0.1; servers are always terminated."""
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from rewards_http import free_port, in_thread_server

from posttrain.rewards import RemoteReward, RewardError, make_reward_source
from posttrain.rewards.python_func import PythonRewardFunction
from posttrain.rewards.remote import TOKEN_ENV

pytestmark = pytest.mark.e2e

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
    cmd = [sys.executable, "-m", "posttrain.cli.serve_rm",
           "--reward.remote_url", str(FUNCS / "plain_reward.py"), "--host", "127.0.0.1", "--port", str(port),
           *flags]
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
    assert (RemoteReward(url, token="s3cret").score(QUERIES, PROMPTS, LABELS).rewards.tolist()
            == [1.0, 0.0, 1.0])
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
        assert (r.status_code == 500 and r.json()["detail"] == "RewardError: reward function r.py raised "
                                                               "KeyError: 'answer'")
        remote = RemoteReward(base + "/get_reward", retries=2, backoff=0.01, timeout=5)
        with pytest.raises(RewardError, match=r"failed after 2 attempts \(HTTP 500: RewardError: reward "
                                              r"function r.py raised KeyError: 'answer'\)"):
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
    assert ("--reward_pretrain: renamed in OpenRLHF 0.10.2; use --reward.model_name_or_path"
            in capsys.readouterr().err)
    args = parse_args(["--reward.model_name_or_path", "m", "--ds.value_head_prefix", "value_head",
                       "--reward.normalize_enable", "--token", "t"])
    assert (args.ds.value_head_prefix, args.reward.normalize_enable, args.token, args.host, args.port) == (
        "value_head", True, "t", "127.0.0.1", 5000)
    args = parse_args(["--reward.remote_url", "f.py", "--reward.timeout", "5", "--reward.retries", "2"])
    assert (args.reward.timeout, args.reward.retries) == (5.0, 2)
    with pytest.raises(SystemExit):
        parse_args(["--reward.remote_url", "f.py", "--reward.retries", "0"])
    assert "--reward.retries 0: must be >= 1" in capsys.readouterr().err
    missing = subprocess.run([sys.executable, "-m", "posttrain.cli.serve_rm", "--reward.remote_url",
                              "/nonexistent/r.py"], check=False, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "reward function file not found" in missing.stderr


# ---------------------------------------------------------------- OpenRLHF 0.10.2 flags, start-up checks

# every flag of OpenRLHF 0.10.2's openrlhf/cli/serve_rm.py, with a value away from its default
OPENRLHF_FLAGS = {
    "--reward.model_name_or_path": "m", "--reward.normalize_enable": None,
    "--ds.value_head_prefix": "value_head", "--data.max_len": "64", "--port": "5001", "--host": "0.0.0.0",
    "--ds.load_in_4bit": None, "--ds.param_dtype": "fp16", "--ds.attn_implementation": "eager",
    "--ds.experts_implementation": "grouped_mm", "--data.disable_fast_tokenizer": None,
    "--ds.packing_samples": None, "--batch_size": "4", "--use_ms": None,
}
EXAMPLE = Path(__file__).parent / "serve_rm_example.sh"


def example_argv(rm_dir) -> list[str]:
    """serve_rm_example.sh's command line after `python -m posttrain.cli.serve_rm`, $RM_DIR filled in."""
    lines = [line for line in EXAMPLE.read_text().splitlines() if not line.lstrip().startswith("#")]
    words = shlex.split(" ".join(line.rstrip("\\") for line in lines))
    assert words[:3] == ["python", "-m", "posttrain.cli.serve_rm"]
    return [str(rm_dir) if w == "$RM_DIR" else w for w in words[3:]]


def model_copy(src, dst, **config):
    """A copy of the tiny score model with `config` merged into its config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


@pytest.fixture(scope="module")
def normalized_rm(tiny_score_model_dir, tmp_path_factory):
    """The tiny score model with the reward statistics that --reward.normalize_enable needs."""
    return model_copy(Path(tiny_score_model_dir), tmp_path_factory.mktemp("srm") / "rm", mean=0.5, std=2.0)


def test_every_openrlhf_flag_parses_and_lands():
    from posttrain.cli.serve_rm import parse_args

    argv = [w for flag, value in OPENRLHF_FLAGS.items() for w in ([flag] if value is None else [flag, value])]
    a = parse_args(argv)
    assert ((a.reward.model_name_or_path, a.reward.normalize_enable, a.ds.value_head_prefix)
            == ("m", True, "value_head"))
    assert (a.data.max_len, a.port, a.host, a.batch_size) == (64, 5001, "0.0.0.0", 4)
    assert (a.ds.load_in_4bit, a.ds.param_dtype, a.ds.attn_implementation) == (True, "fp16", "eager")
    assert (a.ds.experts_implementation, a.data.disable_fast_tokenizer, a.ds.packing_samples, a.use_ms) == (
        "grouped_mm", True, True, True)


def test_openrlhf_example_script_parses_and_resolves_on_cpu(normalized_rm):
    from posttrain.cli.serve_rm import parse_args, startup_notes

    a = parse_args(example_argv(normalized_rm))
    assert (a.reward.model_name_or_path, a.port, a.ds.param_dtype, a.ds.attn_implementation) == (
        str(normalized_rm), 5000, "bf16", "flash_attention_2")
    assert (a.reward.normalize_enable, a.data.max_len, a.batch_size) == (True, 8192, 16)
    notes = "\n".join(startup_notes(a, "cpu"))
    # like the trainers: bf16 kept with a warning, flash attention -> sdpa, and the 4096-position
    # model caps max_len
    assert "WARNING: --ds.param_dtype bf16 on CPU" in notes
    assert "--ds.attn_implementation: flash_attention_2 -> sdpa (flash attention needs a CUDA GPU)" in notes
    assert "--data.max_len: 8192 -> 4096 (the model's position limit" in notes
    assert (a.ds.param_dtype, a.ds.attn_implementation, a.data.max_len) == ("bf16", "sdpa", 4096)


def test_example_script_serves(normalized_rm):
    """The example's command line as a real server: start-up notes printed, rewards normalised,
    the new fields."""
    port = free_port()
    argv = [*example_argv(normalized_rm), "--port", str(port), "--ds.param_dtype", "fp32"]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.serve_rm", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, base)
        r = HTTP.post(base + "/get_reward", json={"query": QUERIES}, timeout=30)
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["rewards"]) == 3 and body["truncated"] == [False] * 3 and body["num_truncated"] == 0
    finally:
        stop(proc)
    log = proc.stdout.read()
    assert "--ds.attn_implementation: flash_attention_2 -> sdpa" in log
    assert "--data.max_len: 8192 -> 4096" in log and "normalize=True" in log


def test_old_max_len_flag_is_refused_naming_the_new_one(capsys):
    from posttrain.cli.serve_rm import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--reward.remote_url", "f.py", "--max_len", "8"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "posttrain serve-rm: error: unknown flag --max_len: renamed in OpenRLHF 0.10.2; use --data.max_len\n")
    with pytest.raises(SystemExit):  # no prefix abbreviations: a typo must not hit another flag
        parse_args(["--reward.remote_url", "f.py", "--ds.param", "fp32"])
    assert "unknown flag --ds.param" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message is only given without CUDA")
def test_load_in_4bit_on_cpu_stops_at_once(tiny_score_model_dir, capsys):
    from posttrain.cli.serve_rm import main

    with pytest.raises(SystemExit) as e:
        main(["--reward.model_name_or_path", tiny_score_model_dir, "--ds.load_in_4bit"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.strip() == ("posttrain serve-rm: error: --ds.load_in_4bit: bitsandbytes 4-bit loading needs a "
                           "CUDA GPU; this run is on CPU")


def test_flags_without_effect_are_named_at_startup(tiny_score_model_dir):
    from posttrain.cli.serve_rm import parse_args, startup_notes

    func = parse_args(["--reward.remote_url", "f.py", "--ds.param_dtype", "bf16", "--data.max_len", "64",
                       "--use_ms", "--ds.no_onednn_linear"])
    assert startup_notes(func, "cpu") == [
        "note: --ds.param_dtype bf16 has no effect here: serve-rm serves a reward_func file, not a model",
        "note: --ds.no_onednn_linear has no effect here: serve-rm serves a reward_func file, not a model",
        "note: --data.max_len 64 has no effect here: serve-rm serves a reward_func file, not a model",
        "note: --use_ms has no effect here: ModelScope downloads are not supported; pass a local folder or "
        "an HF hub id"]
    model = parse_args(["--reward.model_name_or_path", tiny_score_model_dir, "--ds.packing_samples",
                        "--ds.experts_implementation", "eager", "--on_error", "skip"])
    notes = startup_notes(model, "cpu")
    assert notes[:2] == ["--ds.param_dtype: auto -> fp32 (auto for cpu)",
                         "--ds.attn_implementation: auto -> sdpa (auto for cpu)"]
    # --ds.experts_implementation acts on a served model (a dense one refuses it when it loads)
    assert [n.split(" has no effect here")[0] for n in notes if n.startswith("note:")] == [
        "note: --ds.packing_samples", "note: --on_error skip"]


def test_no_onednn_linear_reaches_the_served_model(tiny_score_model_dir):
    """serve-rm loads the reward model with oneDNN linears
    (models/cpu_linear.py) unless --ds.no_onednn_linear."""
    import torch

    from posttrain.models.cpu_linear import OneDNNLinear, onednn_available

    for flags, onednn in (((), onednn_available()), (("--ds.no_onednn_linear",), False)):
        source, notes = model_source("--reward.model_name_or_path", tiny_score_model_dir, *flags)
        linears = [m for m in source.model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all((type(m) is OneDNNLinear) is onednn for m in linears)
        assert not any("onednn" in n for n in notes)


# ---------------------------------------------------------------- requests: bad bodies, long queries, limits

def model_source(*flags):
    """A RewardModelSource built the way `posttrain serve-rm --reward.model_name_or_path ...` builds it."""
    from posttrain.cli.serve_rm import make_source, parse_args, startup_notes

    args = parse_args(list(flags))
    notes = startup_notes(args, "cpu")
    return make_source(args, "cpu"), notes


@pytest.fixture(scope="module")
def rm_source(tiny_score_model_dir):
    return model_source("--reward.model_name_or_path", tiny_score_model_dir, "--data.max_len", "16")[0]


def long_and_short(source):
    tok = source.tokenizer
    long_text, short_text = "Q: say many words. A: " + "apple banana cherry " * 12, "Q: hi A: ok"
    assert len(tok(long_text)["input_ids"]) > 20 > 16 > len(tok(short_text)["input_ids"]) + 1
    return long_text, short_text


def test_bad_bodies_are_400_for_a_reward_model(rm_source):
    with in_thread_server(rm_source) as base:
        url = base + "/get_reward"
        r = HTTP.post(url, json={"query": []}, timeout=10)
        assert r.status_code == 400 and "'query' is an empty list" in r.json()["detail"]
        r = HTTP.post(url, data="[" * 100_000 + "]" * 100_000, timeout=10)  # nested too deep to decode
        assert r.status_code == 400 and "not valid JSON (RecursionError" in r.json()["detail"]
        r = HTTP.post(url, data=b"\xff\xfe{}", timeout=10)
        assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
        r = HTTP.post(url, json={"query": ["a", 3]}, timeout=10)
        assert r.status_code == 400 and "'query' must be a list of strings" in r.json()["detail"]


def test_empty_query_list_is_400_for_a_reward_func(servers):
    _, base = servers["open"]
    r = HTTP.post(base + "/get_reward", json={"query": [], "prompts": [], "labels": []}, timeout=5)
    assert r.status_code == 400 and "at least one prompt + response text" in r.json()["detail"]


def test_long_queries_are_cut_and_reported(rm_source):
    long_text, short_text = long_and_short(rm_source)
    with in_thread_server(rm_source) as base:
        r = HTTP.post(base + "/get_reward", json={"query": [long_text, short_text, long_text]}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["truncated"] == [True, False, True] and body["num_truncated"] == 2
    assert body["extra_logs"]["reward_model/truncated"] == [1.0, 0.0, 1.0]
    ids, mask, _ = rm_source.tokenize([long_text])
    assert int(mask.sum()) == 16 and ids[0, 15].item() == rm_source.tokenizer.eos_token_id  # last token eos
    assert body["rewards"][0] == pytest.approx(rm_source.values(ids, mask).item(), abs=1e-5)


def test_model_position_limit_caps_the_length(tiny_score_model_dir, rm_source, tmp_path):
    """A model with 16 positions: no --data.max_len, or a larger one, still cuts at 16 (and says so)."""
    short_model = model_copy(Path(tiny_score_model_dir), tmp_path / "rm16", max_position_embeddings=16)
    long_text, short_text = long_and_short(rm_source)
    expected = rm_source.score([long_text, short_text]).rewards.tolist()  # cut at --data.max_len 16
    for flags, note in (((), "--data.max_len: auto -> 16"),
                        (("--data.max_len", "1000"), "--data.max_len: 1000 -> 16")):
        source, notes = model_source("--reward.model_name_or_path", str(short_model), *flags)
        assert source.max_len == 16 and any(n.startswith(note) for n in notes), notes
        with in_thread_server(source) as base:
            body = HTTP.post(base + "/get_reward", json={"query": [long_text, short_text]}, timeout=30).json()
        assert body["truncated"] == [True, False] and body["num_truncated"] == 1
        assert body["rewards"] == pytest.approx(expected, abs=1e-5)


@pytest.fixture
def limited_server(monkeypatch):
    """An in-thread reward_func server with --max_request_bytes 2000 --max_queries 3."""
    from posttrain.rewards import server

    monkeypatch.setattr(server, "build_app", functools.partial(server.build_app, max_request_bytes=2000,
                                                                max_queries=3))
    with in_thread_server(PythonRewardFunction(FUNCS / "plain_reward.py")) as base:
        yield base + "/get_reward"


def test_request_size_limit_is_413(limited_server):
    big = {"query": ["x" * 3000], "prompts": [""], "labels": ["x"]}
    r = HTTP.post(limited_server, json=big, timeout=10)
    assert r.status_code == 413
    assert "larger than 2000 bytes (the server's --max_request_bytes)" in r.json()["detail"]
    chunks = (c.encode() for c in [json.dumps(big)[:1500], json.dumps(big)[1500:]])  # no Content-Length
    r = HTTP.post(limited_server, data=chunks, headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413 and "--max_request_bytes" in r.json()["detail"]
    with pytest.raises(RewardError, match=r"HTTP 413: request body larger than 2000 bytes "
                                          r".*--max_request_bytes"):
        RemoteReward(limited_server, timeout=10).score(big["query"], big["prompts"], big["labels"])
    assert HTTP.post(limited_server, json={"query": ["x"] * 3}, timeout=10).status_code == 200


def test_too_many_queries_is_413(limited_server):
    r = HTTP.post(limited_server, json={"query": ["a", "b", "c", "d"]}, timeout=10)
    assert r.status_code == 413
    assert r.json()["detail"].startswith("4 queries in one request; the server takes at most 3 "
                                         "(--max_queries)")


def test_a_port_in_use_stops_serve_rm_with_one_line_before_loading(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "posttrain.cli.serve_rm", "--reward.remote_url",
                               str(FUNCS / "plain_reward.py"), "--port", str(port)], check=False,
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in proc.stderr
    assert "serving" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_lone_surrogate_is_400_and_sys_exit_in_reward_func_is_500(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import sys\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                    "    if queries[0] == 'exit':\n        sys.exit(0)\n    return [1.0] * len(queries)\n")
    with in_thread_server(PythonRewardFunction(path)) as base:
        url = base + "/get_reward"
        body = '{"query": ["ok \\ud800"]}'
        r = HTTP.post(url, data=body, headers={"content-type": "application/json"}, timeout=5)
        assert r.status_code == 400 and "'query'[0] holds a lone UTF-16 surrogate" in r.json()["detail"]
        r = HTTP.post(url, data='{"query": ["a"], "prompts": ["\\udfff"]}', timeout=5)
        assert r.status_code == 400 and "'prompts'[0]" in r.json()["detail"]
        r = HTTP.post(url, json={"query": ["exit"]}, timeout=5)
        assert r.status_code == 500 and "called sys.exit(0) at" in r.json()["detail"]
        assert HTTP.post(url, json={"query": ["a"]}, timeout=5).json()["rewards"] == [1.0]  # still serving


class Slow:
    """A reward source that answers after `delay` seconds."""

    def __init__(self, delay):
        self.delay = delay

    def score(self, queries, prompts, labels=None, **kwargs):
        time.sleep(self.delay)
        return make_reward_source(str(FUNCS / "plain_reward.py")).score(queries, prompts, labels)

    def close(self):
        pass


def test_a_slow_server_is_reported_as_timed_out_not_unreachable():
    with in_thread_server(Slow(1.5)) as base:
        remote = RemoteReward(base + "/get_reward", timeout=0.3, retries=2, backoff=0.01)
        with pytest.raises(RewardError, match=rf"reward server {base}/get_reward timed out after 0.3 s "
                                              r"\(--reward.timeout\) on each of 2 attempts") as err:
            remote.score(["a"], [""], None)
        assert "unreachable" not in str(err.value)
