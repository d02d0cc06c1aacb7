"""`posttrain serve-rm` as a subprocess under faults: a reward_func that never returns (timed-out calls are
answered at once, stuck threads are bounded and reported by /health, requests beyond --max_concurrent get
503), and clients that drop or stall mid-request (one counted log line, no traceback; stalled connections
closed after --read_timeout). All traffic stays on 127.0.0.1; the server is always terminated."""
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
from rewards_http import free_port, raw, read_until_closed

pytestmark = pytest.mark.e2e

HTTP = requests.Session()
HTTP.trust_env = False  # never through a proxy: all traffic stays on 127.0.0.1
HANGS = """import time


def reward_func(queries, prompts, labels, **kwargs):
    time.sleep(3600)  # blocked in C: the abandoning exception cannot stop it
"""
MAX_STUCK = 2  # --reward.max_stuck (default 4)
ANSWER_S = 60  # every request must be answered within this (a liveness bound, not a speed check)


def serve(tmp_path, *flags):
    """serve-rm on a free port serving a reward_func that never returns; (process, base url)."""
    (tmp_path / "hangs.py").write_text(HANGS)
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.serve_rm", "--reward.remote_url",
                             str(tmp_path / "hangs.py"), "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve-rm exited with {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
        try:
            HTTP.get(base + "/health", timeout=1, headers={"Authorization": "Bearer t0k"})
            return proc, base
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("serve-rm did not answer /health within 60 s")


def output(proc) -> str:
    """Everything the server printed, after stopping it."""
    proc.terminate()
    try:
        return proc.communicate(timeout=20)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate(timeout=20)[0]


def threads(proc) -> int:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def health(base):
    r = HTTP.get(base + "/health", timeout=ANSWER_S)
    return r.status_code, r.json()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_a_hanging_reward_func_is_answered_bounded_and_reported(tmp_path):
    proc, base = serve(tmp_path, "--reward.timeout", "2", "--reward.retries", "1", "--max_concurrent", "3",
                       "--reward.max_stuck", str(MAX_STUCK))
    try:
        url, baseline = base + "/get_reward", threads(proc)
        assert health(base)[1]["status"] == "ok"
        r = HTTP.post(url, json={"query": ["a"]}, timeout=ANSWER_S)
        assert r.status_code == 500 and "did not return within 2s (--reward.timeout)" in r.json()["detail"]
        code, body = health(base)
        assert (code, body["status"], body["stuck_calls"]) == (200, "degraded", 1)

        answers, start = [], threading.Barrier(8)

        def ask():
            start.wait()
            # raises when not answered in time
            r = requests.post(url, json={"query": ["a"]}, timeout=ANSWER_S)
            answers.append((r.status_code, r.json()["detail"]))

        workers = [threading.Thread(target=ask) for _ in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        assert len(answers) == 8  # every request answered
        busy = [d for c, d in answers if c == 503 and d.startswith("server busy")]
        assert busy and "(--max_concurrent 3)" in busy[0]
        assert all(c in (500, 503) for c, _ in answers)

        code, body = health(base)  # MAX_STUCK threads stuck at most: no call is started any more
        assert (code, body["status"], body["stuck_calls"]) == (503, "unavailable", MAX_STUCK)
        r = HTTP.post(url, json={"query": ["b"]}, timeout=ANSWER_S)
        assert r.status_code == 503 and r.json()["detail"].startswith("RewardBusy: ")
        assert "no new call is started" in r.json()["detail"]
        assert threads(proc) <= baseline + MAX_STUCK + 2  # the stuck calls, and anyio's worker thread
    finally:
        text = output(proc)
    assert "Traceback" not in text, text[-3000:]


def test_dropped_and_stalled_clients_are_counted_and_closed(tmp_path):
    read_timeout = 2
    proc, base = serve(tmp_path, "--read_timeout", str(read_timeout), "--token", "t0k")
    auth = b"Authorization: Bearer t0k\r\n"
    head = b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    try:
        raw(base, head + auth + b"Content-Length: 1000\r\n\r\n" + b'{"query": ', close=True)  # gone mid-body
        stalled = {
            "headers": raw(base, head + auth),  # half the headers, then nothing
            "body": raw(base, head + auth + b"Content-Length: 1000\r\n\r\n" + b'{"query": '),
            "unread body": raw(base, head + b"Content-Length: 1000\r\n\r\n" + b'{"query": '),  # 401 first
        }
        got = {k: read_until_closed(s, read_timeout + 10) for k, s in stalled.items()}
        assert got["headers"].startswith(b"HTTP/1.1 408 ")
        assert got["body"].startswith(b"HTTP/1.1 408 ") and b"--read_timeout" in got["body"]
        assert got["unread body"].startswith(b"HTTP/1.1 401 ")
        r = HTTP.get(base + "/health", headers={"Authorization": "Bearer t0k"}, timeout=ANSWER_S)
        assert r.status_code == 200  # still serving
    finally:
        text = output(proc)
    assert "Traceback" not in text and "ClientDisconnect" not in text, text[-3000:]
    gone = [line for line in text.splitlines() if "closed its connection before sending the whole" in line]
    assert len(gone) == 1 and gone[0].endswith("(1 disconnected so far)"), text[-3000:]
    late = [line for line in text.splitlines() if f"not complete within {read_timeout} s "
                                                  f"(--read_timeout)" in line]
    assert len(late) == 3 and late[-1].endswith("(3 timed out so far)"), text[-3000:]
