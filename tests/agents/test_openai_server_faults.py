"""The agents' OpenAI-compatible server in a subprocess, under clients that drop or stall mid-request: one
counted log line and no traceback for a client gone mid-body; stalled connections closed after the
executor's read_timeout. All traffic stays on 127.0.0.1; the server process is always killed."""
import subprocess
import sys

import pytest
from rewards_http import raw, read_until_closed

pytestmark = pytest.mark.e2e

READ_TIMEOUT = 2
SERVE = f"""
import time
from posttrain.agents.openai_server import OpenAIServerAgentExecutor, Session

class Executor(OpenAIServerAgentExecutor):
    read_timeout = {READ_TIMEOUT}

executor = Executor()
executor._ensure_server(None)  # the paths under test never tokenise
executor.sessions["k3y"] = Session("s", "k3y", "", "policy", None, None, None)  # a live session's token
print("PORT", executor.port, flush=True)
time.sleep(300)
"""


def test_dropped_and_stalled_clients_are_counted_and_closed():
    proc = subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line + proc.stdout.read()[-3000:]
        base = f"http://127.0.0.1:{int(line.split()[1])}"
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer k3y\r\n")
        raw(base, head + b"Content-Length: 1000\r\n\r\n" + b'{"messages": ', close=True)  # gone mid-body
        stalled = {"headers": raw(base, head),  # half the headers, then nothing
                   "body": raw(base, head + b"Content-Length: 1000\r\n\r\n" + b'{"messages": ')}
        got = {k: read_until_closed(s, READ_TIMEOUT + 10) for k, s in stalled.items()}
        assert got["headers"].startswith(b"HTTP/1.1 408 ")
        assert (got["body"].startswith(b"HTTP/1.1 408 ")
                and b"OpenAIServerAgentExecutor.read_timeout" in got["body"])
    finally:
        proc.kill()
        text = proc.communicate(timeout=20)[0]
    assert "Traceback" not in text and "ClientDisconnect" not in text, text[-3000:]
    gone = [line for line in text.splitlines() if "closed its connection before sending the whole" in line]
    assert len(gone) == 1 and gone[0].endswith("(1 disconnected so far)"), text[-3000:]
    late = [line for line in text.splitlines() if "(OpenAIServerAgentExecutor.read_timeout)" in line]
    assert len(late) == 2 and late[-1].endswith("(2 timed out so far)"), text[-3000:]
