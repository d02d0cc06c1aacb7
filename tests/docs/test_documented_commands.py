"""Every `posttrain` command in README.md and docs/*.md runs as written from the repository root.

The parse check (fast) reads each command's flags as its command reads them. The run check (e2e) runs
each page's commands in page order in a scratch folder that sees the repository's `examples/` and
`posttrain/` (reward files are given by path), shortened by the flags `shorten` appends to the command
(the last value of a flag wins). README.md runs first; the run folders it leaves (`runs/tiny`,
`runs/sft`, ...) serve the other pages' commands that read a run folder the page does not make itself.
A command `NOT_RUN` names (by command or flag) is parsed but not run, for the reason given there.
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import ROOT, Command, WriteFile, pages, steps

TRAINERS = ("sft", "rm", "dpo", "ppo", "serve-rm")
PPO_SHORT = ["--train.max_steps", "1", "--rollout.max_new_tokens", "4"]  # one rollout step, short samples


def shorten(argv: list[str]) -> list[str]:
    """The flags that make a documented run short without changing its batch sizes: one optimizer step of
    the command's own `--train.batch_size` (SFT, RM, DPO: as many rows, one epoch), one rollout step (PPO).
    A command that sets `--data.max_samples` is short already."""
    if argv[0] == "ppo":
        return PPO_SHORT
    if argv[0] not in ("sft", "rm", "dpo") or "--data.max_samples" in argv:
        return []
    from posttrain.config.parser import parse_config

    batch = parse_config(argv[0], argv[1:], check=False).train.batch_size
    return ["--data.max_samples", str(batch), "--train.max_epochs", "1"]


NOT_RUN = {  # command name or flag -> why such a command is only parsed
    "serve-rm": "serves until it is stopped (tests/rewards test the server)",
    "demo": "the whole demo takes ~15 minutes (tests/test_demo.py runs `posttrain demo --quick`)",
    "--vllm.num_engines": "Ray with rollout engines starts in ~2 minutes on 2 cores, over this test's budget "
                          "(tests/trainers/rl/test_rl_ray.py runs 2 actor ranks with 2 engines)",
}
CHAT_INPUT = "What is 12 + 3?\n"
OUTPUT_FLAGS = ("--output", "--ckpt.output_dir", "--ckpt.path", "--output_path")


def not_run(cmd: Command) -> str | None:
    """Why `cmd` is only parsed, or None: it runs."""
    return next((why for key, why in NOT_RUN.items() if key in cmd.argv), None)


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


def _run(cmd: Command, cwd: Path, shared: Path | None) -> None:
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
    ray = any(a in ("--vllm.num_engines", "--actor.num_gpus_per_node", "--actor.num_nodes") for a in argv)
    if ray or cmd.env:  # Ray's session outlives the command in-process: a process of its own
        env = {**os.environ, **dict(cmd.env), "PYTHONPATH": str(ROOT)}
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


def _run_page(page: str, cwd: Path, shared: Path | None, seen: set) -> list[str]:
    """Run the page's steps; a command run as written on an earlier page is not run again (its run folder,
    README's, is linked where a later command reads it)."""
    cwd.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "posttrain"):
        (cwd / name).symlink_to(ROOT / name)
    ran = []
    for step in steps(page):
        if isinstance(step, WriteFile):
            (cwd / step.path).write_text(step.text)
        elif not_run(step) is None and step.argv not in seen:
            _run(step, cwd, shared)
            seen.add(step.argv)
            ran.append(str(step))
    return ran


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    cwd, seen = tmp_path_factory.mktemp("docs") / "README", set()
    return cwd, _run_page("README.md", cwd, None, seen), seen


@pytest.mark.e2e
def test_readme_commands_run(readme_runs):
    cwd, ran, _ = readme_runs
    assert ran and (cwd / "runs" / "sft" / "config.json").exists()


@pytest.mark.e2e
@pytest.mark.parametrize("page", [p for p in pages() if p != "README.md"])
def test_docs_page_commands_run(page, readme_runs, tmp_path):
    _run_page(page, tmp_path / "page", readme_runs[0], readme_runs[2])
