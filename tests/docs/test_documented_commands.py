"""Every `posttrain` command in README.md and docs/*.md runs as written from the repository root.

The parse check (fast) reads each command's flags as its command reads them. The run check (e2e) runs
each page's commands in page order in a scratch folder that sees the repository's `examples/` and
`posttrain/` (reward files are given by path), shortened by the flags `shorten` appends to the command
(the last value of a flag wins). README.md runs first; the run folders it leaves (`runs/tiny`,
`runs/sft`, ...) serve the other pages' commands that read a run folder the page does not make itself.
Every documented command runs: `serve-rm` in the background until it has answered a scored request (its
own check, `_serve_rm`); README's `OWN_TEST` commands each in a test of their own: RL on Ray with vLLM
engines (`test_readme_command_of_its_own`, from README's folder once its other commands ran) and the demo
(test_readme_demo.py, which reads no run folder of README's).
"""
from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_commands import ROOT, Command, WriteFile, pages, steps

TRAINERS = ("sft", "rm", "dpo", "kd", "kto", "prm", "ppo", "serve-rm")
PPO_SHORT = ["--train.max_steps", "1", "--rollout.max_new_tokens", "4"]  # one rollout step, short samples


def shorten(argv: list[str]) -> list[str]:
    """The flags that make a documented run short without changing its batch sizes: one optimizer step of
    the command's own `--train.batch_size` (SFT, RM, DPO, KD, KTO, PRM: as many rows, one epoch), one
    rollout step (PPO), the demo's small variant (`--quick`, what `make demo-quick` runs). A command that
    sets `--data.max_samples` is short already."""
    if argv[0] == "demo":
        return ["--quick"]
    if argv[0] == "ppo":
        return PPO_SHORT
    if argv[0] not in ("sft", "rm", "dpo", "kd", "kto", "prm") or "--data.max_samples" in argv:
        return []
    from posttrain.config.parser import parse_config

    batch = parse_config(argv[0], argv[1:], check=False).train.batch_size
    return ["--data.max_samples", str(batch), "--train.max_epochs", "1"]


OWN_TEST = ("demo", "--vllm.num_engines")  # a README command naming one runs in a test of its own
CHAT_INPUT = "What is 12 + 3?\n"
OUTPUT_FLAGS = ("--output", "--ckpt.output_dir", "--ckpt.path", "--output_path")


def own_test(cmd: Command) -> bool:
    """README's `cmd` runs in `test_readme_command_of_its_own` (the demo, ~1 min; Ray with vLLM engines)."""
    return cmd.page == "README.md" and any(key in cmd.argv for key in OWN_TEST)


def _all_commands() -> list[Command]:
    return [s for page in pages() for s in steps(page) if isinstance(s, Command)]


def _parse(cmd: Command) -> None:
    """Read the command's flags as the command does (no model, no data touched)."""
    from posttrain.cli.main import COMMANDS

    name, argv = cmd.argv[0], list(cmd.argv[1:])
    assert name in COMMANDS, f"{cmd}: unknown command {name!r}"
    assert "..." not in argv, f"{cmd}: elided flags ('...'); write the full command or a flag list"
    if name in TRAINERS:
        from posttrain.config.parser import parse_config

        parse_config(name, _without_config(argv), check=False)  # a --config file is written by the page
    elif name in ("lora-merge", "ds-to-hf"):
        import importlib

        importlib.import_module(COMMANDS[name][0])._parser().parse_args(argv)


def _without_config(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip or a == "--config":
            skip = a == "--config"
            continue
        out.append(a)
    return out


@pytest.mark.parametrize("cmd", _all_commands(), ids=str)
def test_documented_command_parses(cmd):
    _parse(cmd)


def test_commands_are_found():
    """The extraction sees the pages' commands (a change of fence style would silently find none)."""
    found = _all_commands()
    names = {c.argv[0] for c in found}
    assert {"init-tiny", "sft", "rm", "dpo", "ppo", "lora-merge", "ds-to-hf", "plot"} <= names
    assert any(c.page == "README.md" for c in found) and len({c.page for c in found}) >= 8


def run_command(cmd: Command, cwd: Path, shared: Path | None, env: dict | None = None) -> None:
    """Run `cmd` shortened in `cwd` (`env`: variables for a command run as a process of its own)."""
    argv = list(cmd.argv)
    top = lambda word: Path(*Path(word).parts[:2]) if word.startswith("runs/") else None  # noqa: E731
    outputs = {top(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a in OUTPUT_FLAGS}
    if shared is not None:  # run folders this page reads but does not make: those of README (folder `shared`)
        config = argv[argv.index("--config") + 1] if "--config" in argv else None
        for word in argv + ((cwd / config).read_text().split() if config else []):  # a config names them too
            run = top(word)
            if run and run not in outputs and not (cwd / run).exists() and (shared / run).exists():
                (cwd / run).parent.mkdir(exist_ok=True)
                (cwd / run).symlink_to(shared / run)
    argv += shorten(argv)
    env = {**os.environ, **dict(cmd.env), **(env or {}), "PYTHONPATH": str(ROOT)}
    if argv[0] == "serve-rm":
        _serve_rm(argv, cwd, env)
        return
    ray = any(a in ("--vllm.num_engines", "--actor.num_gpus_per_node", "--actor.num_nodes") for a in argv)
    if ray or cmd.env:  # Ray's session outlives the command in-process: a process of its own
        done = subprocess.run([sys.executable, "-m", "posttrain.cli.main", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=900, check=False)
        assert done.returncode == 0, f"{cmd}\nexit {done.returncode}\n{done.stderr[-3000:]}"
        return
    from posttrain.cli.main import main

    old, stdin = os.getcwd(), sys.stdin
    os.chdir(cwd)
    sys.stdin = io.StringIO(CHAT_INPUT)  # `posttrain chat` answers one message, then reads the end of input
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), f"{cmd}: exit {e.code}"
    finally:
        os.chdir(old)
        sys.stdin = stdin


def _port_free(port: int) -> bool:
    """`port` on 127.0.0.1 can be bound (as serve-rm checks it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _serve_rm(argv: list[str], cwd: Path, env: dict) -> None:
    """Run `posttrain serve-rm` in the background until it scores a request sent with its `--token` (and
    refuses one without), then stop it with Ctrl-C (SIGINT): it exits 0. The documented `--port` is used
    when it is free; where another process holds it (a CI machine may), a free port takes its place."""
    import requests

    port = int(argv[argv.index("--port") + 1])
    if not _port_free(port):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        argv = [*argv, "--port", str(port)]
    token = argv[argv.index("--token") + 1]
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {token}"}
    body = {"query": ["What is 17 + 5? 22"], "prompts": ["What is 17 + 5?"]}
    with open(cwd / "serve-rm.log", "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", *argv], cwd=cwd, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):  # the model loads in seconds; 5 minutes on a loaded machine at most
                assert proc.poll() is None, f"serve-rm exited {proc.returncode}:\n{_tail(log)}"
                try:
                    scored = requests.post(f"{url}/get_reward", json=body, headers=auth, timeout=30)
                    break
                except requests.ConnectionError:
                    time.sleep(0.5)
            else:
                raise AssertionError(f"serve-rm did not answer on port {port}:\n{_tail(log)}")
            assert scored.status_code == 200, scored.text
            assert len(scored.json()["rewards"]) == 1 and isinstance(scored.json()["rewards"][0], float)
            assert requests.post(f"{url}/get_reward", json=body, timeout=30).status_code == 401
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, _tail(log)
            assert "Traceback" not in _tail(log)
        finally:
            proc.kill()


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-3000:]


def _run_page(page: str, cwd: Path, shared: Path | None, seen: set) -> list[str]:
    """Run the page's steps; a command run as written on an earlier page is not run again (its run folder,
    README's, is linked where a later command reads it), nor one that runs in a test of its own (`own_test`).
    """
    cwd.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "posttrain"):
        (cwd / name).symlink_to(ROOT / name)
    ran = []
    for step in steps(page):
        if isinstance(step, WriteFile):
            (cwd / step.path).write_text(step.text)
        elif step.argv not in seen:
            if not own_test(step):
                run_command(step, cwd, shared)
                ran.append(str(step))
            seen.add(step.argv)
    return ran


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    cwd, seen = tmp_path_factory.mktemp("docs") / "README", set()
    return cwd, _run_page("README.md", cwd, None, seen), seen


@pytest.mark.e2e
def test_readme_commands_run(readme_runs):
    cwd, ran, _ = readme_runs
    assert ran and (cwd / "runs" / "sft" / "config.json").exists()
    assert any(" serve-rm " in line for line in ran)


@pytest.mark.e2e
@pytest.mark.parametrize("cmd", [c for c in steps("README.md")
                                 if isinstance(c, Command) and own_test(c) and c.argv[0] != "demo"],
                         ids=lambda c: "ray-vllm")
def test_readme_command_of_its_own(cmd, readme_runs):
    """RL on Ray with vLLM engines: one rollout step of short samples in a local Ray the run starts; the
    engines are vLLM's CPU build where it is installed, as the command says at start-up, and compiled as the
    command asks (torch.compile on: the suite's one run of compiled vLLM engines, whose weight syncs the run
    verifies; tests/conftest.py turns it off elsewhere, and the session's Ray workers inherit that). (The
    demo, the other command of its own: test_readme_demo.py.)"""
    cwd = readme_runs[0]
    run_command(cmd, cwd, None, env={"RAY_ADDRESS": "", "TORCH_COMPILE_DISABLE": "0"})
    out = cwd / cmd.argv[cmd.argv.index("--ckpt.output_dir") + 1]
    assert (out / "config.json").exists() and (out / "summary.json").exists()


def test_make_demo_runs_the_documented_demo_command():
    """`make demo` runs README's demo command (which test_readme_demo.py runs)."""
    recipe = re.search(r"^demo: .*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    demo = next(c for c in steps("README.md") if isinstance(c, Command) and c.argv[0] == "demo")
    assert recipe.split() == ["$(VENV)/bin/posttrain", *demo.argv]


@pytest.mark.e2e
@pytest.mark.parametrize("page", [p for p in pages() if p != "README.md"])
def test_docs_page_commands_run(page, readme_runs, tmp_path):
    _run_page(page, tmp_path / "page", readme_runs[0], readme_runs[2])
