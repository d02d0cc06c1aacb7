"""Faults of real `posttrain sft` processes on the nano model: checkpoints of another run, resume with
other flags, kill -9 and resume, two writers into one run directory or one checkpoint folder, Ctrl-C,
SIGTERM, a full disk (also when torch or safetensors lose the errno), a crafted state file, unusable
folders. A run whose fault the test injects by patching (a full disk), and the run that resumes a killed one,
run in this process through the console command's entry (`sft_here`); the rest are processes of their own.

Each process trains 16 samples in batches of 4 (4 steps per epoch). Waits poll the file system for
what the test needs (a checkpoint, a marker file) with a generous deadline; no test depends on how
fast a step runs."""
import collections
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.utils.checkpoint import CheckpointManager, verify_checkpoint
from posttrain.utils.metrics import read_metrics
from posttrain.utils.run_lock import LOCK_FILE

pytestmark = pytest.mark.e2e

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "posttrain.cli.main", "sft"]
DEADLINE_S = 240  # a guard against a hung test, not a speed requirement


def flags(model, data, out, *extra) -> list[str]:
    return [str(f) for f in (
        "--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
        "--data.output_key", "response", "--data.apply_chat_template", "--data.max_len", 48,
        "--data.max_samples", 16, "--train.batch_size", 4, "--train.micro_batch_size", 4,
        "--train.max_epochs", 1, "--adam.lr", 1e-3, "--ckpt.output_dir", out, *extra)]


def run(args, timeout=DEADLINE_S) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=timeout, check=False)


def trained(args) -> None:
    """A run a test only starts from (its checkpoints, its folder): `posttrain sft args`, in this process."""
    from posttrain.cli import train_sft

    train_sft.main(args)


def start(args, log: Path) -> subprocess.Popen:
    """A background run whose stderr goes to `log` (a pipe nobody reads would fill up and stall it).
    SIGINT is reset to Python's default handler in case the test runner ignores it."""
    with log.open("w") as f:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=f, text=True, env=ENV,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.log = log
    return proc


def finish(proc: subprocess.Popen) -> str:
    """Wait for `proc` and return its stderr."""
    proc.wait(timeout=DEADLINE_S)
    return proc.log.read_text()


def wait_for(condition, proc: subprocess.Popen, what: str):
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        found = condition()
        if found:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}:\n"
                                 f"{proc.log.read_text()[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"no {what} after {DEADLINE_S} s")


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[-1]


def snapshot(folder: Path) -> dict:
    """Every checkpoint file (the lock file names its latest holder and may change)."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*")
            if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture(scope="module")
def earlier_run(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """Checkpoints 4, 6, 8 of an earlier run (seed 1, 2 epochs), written in-process."""
    from posttrain.cli import train_sft

    root = tmp_path_factory.mktemp("earlier")
    ckpt = root / "ckpt"
    train_sft.main(flags(tiny_model_dir, arithmetic_dir, root / "run", "--train.seed", 1,
                         "--train.max_epochs", 2, "--ckpt.path", ckpt, "--ckpt.save_steps", 2))
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step4", "global_step6",
                                                                  "global_step8"]
    return ckpt


def test_fresh_run_into_another_runs_checkpoints_is_refused(earlier_run, tiny_model_dir, arithmetic_dir,
                                                            tmp_path):
    before = snapshot(earlier_run)
    proc = run(CLI + flags(tiny_model_dir, arithmetic_dir, tmp_path / "new", "--train.seed", 1,
                           "--ckpt.path", earlier_run, "--ckpt.save_steps", 2))
    assert proc.returncode == 2
    assert error_line(proc.stderr) == (
        f"posttrain sft: error: --ckpt.path {earlier_run} already holds checkpoints (steps 4, 6, 8) of an "
        f"earlier run; pass --ckpt.load_enable to resume it, or choose another (or empty) --ckpt.path")
    assert "Loading weights" not in proc.stderr  # refused before any model loads
    assert snapshot(earlier_run) == before and not (tmp_path / "new" / "config.yaml").exists()


def test_resume_with_another_seed_is_refused_naming_the_flag(earlier_run, tiny_model_dir, arithmetic_dir,
                                                             tmp_path):
    before = snapshot(earlier_run)
    proc = run(CLI + flags(tiny_model_dir, arithmetic_dir, tmp_path / "resume", "--train.seed", 2,
                           "--train.max_epochs", 2, "--ckpt.path", earlier_run, "--ckpt.load_enable"))
    assert proc.returncode == 2
    line = error_line(proc.stderr)
    assert line.startswith(
        f"posttrain sft: error: cannot resume from checkpoint {earlier_run / 'global_step8'}: ")
    assert "(--train.seed: checkpoint 1, this run 2)" in line and "another --ckpt.path" in line
    assert snapshot(earlier_run) == before


def test_resume_after_kill_9_continues_from_the_last_good_checkpoint(tiny_model_dir, arithmetic_dir,
                                                                     tmp_path, capfd):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"  # --ckpt.path unset: it follows --ckpt.output_dir
    long_run = start(CLI + flags(tiny_model_dir, arithmetic_dir, out, "--train.max_epochs", 100,
                                 "--ckpt.save_steps", 2, "--ckpt.max_num", 2), tmp_path / "killed.log")
    wait_for(lambda: list(ckpt.glob("global_step*")), long_run, "a checkpoint")
    long_run.send_signal(signal.SIGKILL)
    finish(long_run)
    step, last = CheckpointManager(ckpt).valid_checkpoints()[0]
    epochs = step // 4 + 1  # the resumed run ends a few steps after the checkpoint
    proc = sft_here(capfd, flags(tiny_model_dir, arithmetic_dir, out, "--train.max_epochs", epochs,
                                 "--ckpt.save_steps", 2, "--ckpt.max_num", 2, "--ckpt.load_enable"))
    assert proc.returncode == 0, proc.stderr[-3000:]  # the dead run's lock does not block
    assert f"resumed from {last} at step {step}" in proc.stderr
    assert f"--train.max_epochs: checkpoint 100, this run {epochs}" in proc.stderr  # run length may change
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert steps == list(range(1, 4 * epochs + 1))  # rows after the checkpoint were dropped, then rewritten
    assert not list(ckpt.glob(".tmp_step*")) and (out / "model.safetensors").exists()


DRIVER_PAUSE = """
import pathlib, sys, time
from posttrain.utils.metrics import MetricsLogger
marker, go, at = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
log = MetricsLogger.log
def paused_log(self, step, metrics):
    log(self, step, metrics)
    if step == at:  # hold the run directory until the test says go
        marker.touch()
        while not go.exists():
            time.sleep(0.05)
MetricsLogger.log = paused_log
from posttrain.cli.main import main
main(["sft", *sys.argv[4:]])
"""


def test_second_writer_into_one_output_dir_is_refused(tiny_model_dir, arithmetic_dir, tmp_path):
    out = tmp_path / "run"
    marker, go = tmp_path / "training", tmp_path / "go"
    first = start([sys.executable, "-c", DRIVER_PAUSE, marker, go, "1",
                   *flags(tiny_model_dir, arithmetic_dir, out)], tmp_path / "first.log")
    try:
        wait_for(marker.exists, first, "the first run's first step")
        second = run(CLI + flags(tiny_model_dir, arithmetic_dir, out, "--train.seed", 7))
        assert second.returncode == 2
        line = error_line(second.stderr)
        assert line.startswith(f"posttrain sft: error: --ckpt.output_dir {out} is in use by another "
                               f"posttrain run (pid {first.pid}, started ")
        assert line.endswith("; wait for it or choose another --ckpt.output_dir")
    finally:
        go.touch()
    err = finish(first)
    assert first.returncode == 0, err[-3000:]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]  # the first run's, alone
    assert (out / "model.safetensors").exists()


def test_second_run_into_a_live_runs_checkpoint_folder_is_refused(tiny_model_dir, arithmetic_dir, tmp_path):
    """Run A keeps its checkpoints in its run directory (--ckpt.path unset); run B, with a run directory
    of its own, points --ckpt.path at them: B is refused by the checkpoint folder's own lock."""
    a_out, ckpt = tmp_path / "A", tmp_path / "A" / "checkpoints"
    marker, go = tmp_path / "training", tmp_path / "go"
    first = start([sys.executable, "-c", DRIVER_PAUSE, marker, go, "2",
                   *flags(tiny_model_dir, arithmetic_dir, a_out, "--ckpt.save_steps", 1, "--ckpt.max_num",
                          1)],
                  tmp_path / "first.log")
    try:
        wait_for(marker.exists, first, "the first run's second step")
        before = snapshot(ckpt)
        assert [p.name for p in ckpt.glob("global_step*")] == ["global_step1"]
        second = run(CLI + flags(tiny_model_dir, arithmetic_dir, tmp_path / "B", "--ckpt.path", ckpt,
                                 "--ckpt.load_enable", "--ckpt.save_steps", 1, "--ckpt.max_num", 1))
        assert second.returncode == 2
        line = error_line(second.stderr)
        assert line.startswith(f"posttrain sft: error: --ckpt.path {ckpt} is in use by another posttrain run "
                               f"(pid {first.pid}, started "), line
        assert "Loading weights" not in second.stderr and snapshot(ckpt) == before
    finally:
        go.touch()
    err = finish(first)
    assert first.returncode == 0, err[-3000:]
    assert [p.name for p in ckpt.glob("global_step*")] == ["global_step4"]  # A's own rotation, alone
    assert verify_checkpoint(ckpt / "global_step4") is None


def test_ctrl_c_ends_with_one_line_and_no_temp_folders(tiny_model_dir, arithmetic_dir, tmp_path):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    proc = start(CLI + flags(tiny_model_dir, arithmetic_dir, out, "--train.max_epochs", 100,
                             "--ckpt.save_steps", 1, "--ckpt.max_num", 2), tmp_path / "run.log")
    wait_for(lambda: list(ckpt.glob("global_step*")), proc, "a checkpoint")
    proc.send_signal(signal.SIGINT)
    err = finish(proc)
    assert proc.returncode == 2
    line = error_line(err)
    assert line.startswith("posttrain sft: error: interrupted at step "), err[-3000:]
    step = int(line.split("interrupted at step ")[1].split(";")[0])
    last = Path(line.split("; last checkpoint: ")[1])
    assert last.parent == ckpt and verify_checkpoint(last) is None
    assert step - 1 <= int(last.name.removeprefix("global_step")) <= step  # saved every step
    assert not list(ckpt.glob(".tmp_step*")) and not list(ckpt.glob(".old_step*"))


def test_sigterm_ends_with_one_line_exit_143_and_no_temp_folders(tiny_model_dir, arithmetic_dir, tmp_path):
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    proc = start(CLI + flags(tiny_model_dir, arithmetic_dir, out, "--train.max_epochs", 100,
                             "--ckpt.save_steps", 1, "--ckpt.max_num", 2), tmp_path / "run.log")
    wait_for(lambda: list(ckpt.glob("global_step*")), proc, "a checkpoint")
    proc.send_signal(signal.SIGTERM)
    err = finish(proc)
    assert proc.returncode == 143, err[-3000:]
    line = error_line(err)
    assert line.startswith("posttrain sft: error: terminated at step "), err[-3000:]
    last = Path(line.split("; last checkpoint: ")[1])
    assert last.parent == ckpt and verify_checkpoint(last) is None
    assert not list(ckpt.glob(".tmp_step*")) and not list(ckpt.glob(".old_step*"))


def sft_here(capfd, args) -> subprocess.CompletedProcess:
    """`posttrain sft args` in this process, through the console command's entry (`in_process`): for the
    faults a test injects by patching (a full disk), where a process of its own adds nothing."""
    from tests.cli.test_cli_input_errors import in_process

    return in_process(capfd, "sft", *args)


def no_space(path):
    """shutil.disk_usage of a full file system."""
    return collections.namedtuple("usage", "total used free")(1 << 30, 1 << 30, 0)


def _disk_full_at_step_4_keeps_step_2(capfd, model_dir, data_dir, tmp_path) -> None:
    """SFT saving every 2 steps, whose step-4 save fails for lack of space (the test patched it): one line
    naming step 4 and the kept step 2, which still verifies; nothing half-written is left."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    proc = sft_here(capfd, flags(model_dir, data_dir, out, "--ckpt.save_steps", 2))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"posttrain sft: error: no space left on device while writing checkpoint step 4 to {ckpt}; the last "
        f"good checkpoint is {ckpt / 'global_step2'} (free space or lower --ckpt.max_num)")
    assert verify_checkpoint(ckpt / "global_step2") is None
    assert [p.name for p in ckpt.iterdir()
            if p.name.startswith(("global_step", ".tmp", ".old"))] == ["global_step2"]


def test_disk_full_while_checkpointing_keeps_the_earlier_checkpoint(tiny_model_dir, arithmetic_dir, tmp_path,
                                                                    monkeypatch, capfd):
    from posttrain.engines.torch_engine import TorchEngine

    save_state, calls = TorchEngine.save_state, []

    def full_disk(self, directory):
        calls.append(directory)
        if len(calls) == 2:  # the 2nd save (step 4's): write part of it, then the disk is full
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "model.pt"), "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return save_state(self, directory)

    monkeypatch.setattr(TorchEngine, "save_state", full_disk)
    _disk_full_at_step_4_keeps_step_2(capfd, tiny_model_dir, arithmetic_dir, tmp_path)


def test_disk_full_reported_by_torch_without_errno_keeps_the_earlier_checkpoint(tiny_model_dir,
                                                                                  arithmetic_dir, tmp_path,
                                                                                  monkeypatch, capfd):
    import torch

    save, calls = torch.save, []

    def torch_save(obj, f, *a, **k):
        calls.append(f)
        # 4 torch.save calls per checkpoint (model, optimizer, scheduler, trainer state): the 5th is step
        # 4's model, failed as torch 2.13 reports a full disk (no errno, no 'No space left'); the file system
        # is full from then on
        if len(calls) == 5:
            with open(f, "wb") as out:
                out.write(b"partial")
            monkeypatch.setattr(shutil, "disk_usage", no_space)
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4224 vs 4118; "
                               "basic_ios::clear: iostream error")
        return save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", torch_save)
    _disk_full_at_step_4_keeps_step_2(capfd, tiny_model_dir, arithmetic_dir, tmp_path)


def test_disk_full_during_the_final_export_is_one_line(tiny_model_dir, arithmetic_dir, tmp_path, monkeypatch,
                                                       capfd):
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    def save_file(*a, **k):  # the final export on a full disk
        monkeypatch.setattr(shutil, "disk_usage", no_space)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(mu, "safe_save_file", save_file)
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    proc = sft_here(capfd, flags(tiny_model_dir, arithmetic_dir, out, "--ckpt.save_steps", 4))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert error_line(proc.stderr) == (
        f"posttrain sft: error: no space left on device while writing the final model to {out}; the last "
        f"good checkpoint is {ckpt / 'global_step4'} (free space, then resume with --ckpt.load_enable or run "
        "again)")
    assert verify_checkpoint(ckpt / "global_step4") is None and not (out / "model.safetensors").exists()


class RunsCode:
    """Unpickling it writes the marker file (what a crafted checkpoint would do with os.system)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_crafted_state_file_is_not_unpickled_on_resume(tiny_model_dir, arithmetic_dir, tmp_path):
    import json

    import torch

    from posttrain.utils.checkpoint import MANIFEST, _crc32

    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    trained(flags(tiny_model_dir, arithmetic_dir, out, "--ckpt.save_steps", 2))
    step = ckpt / "global_step4"
    state = step / "trainer_rank0.pt"
    marker = tmp_path / "code_ran"
    torch.save({"rng": RunsCode(marker)}, state)
    manifest = json.loads((step / MANIFEST).read_text())  # the CRC recomputed: the file verifies
    manifest["files"]["trainer_rank0.pt"] = [state.stat().st_size, _crc32(state)]
    (step / MANIFEST).write_text(json.dumps(manifest))
    assert verify_checkpoint(step) is None
    proc = run(CLI + flags(tiny_model_dir, arithmetic_dir, out, "--ckpt.save_steps", 2, "--ckpt.load_enable",
                           "--train.max_epochs", 2))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert not marker.exists()
    assert error_line(proc.stderr).startswith(
        f"posttrain sft: error: checkpoint file {state} holds objects other than tensors and plain values")


def test_unusable_output_folders_are_one_line(tiny_model_dir, arithmetic_dir, tmp_path):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    proc = run(CLI + flags(tiny_model_dir, arithmetic_dir, a_file))
    assert proc.returncode == 2
    assert error_line(proc.stderr) == (f"posttrain sft: error: --ckpt.output_dir {a_file} is a file, not a "
                                       "folder; choose a folder path for --ckpt.output_dir")
    proc = run(CLI + flags(tiny_model_dir, arithmetic_dir, tmp_path / "run", "--ckpt.path", a_file / "ck",
                           "--ckpt.save_steps", 2))
    assert proc.returncode == 2
    assert error_line(proc.stderr) == (f"posttrain sft: error: --ckpt.path {a_file / 'ck'} lies under "
                                       f"{a_file}, which is a file, not a folder; choose a folder path for "
                                       "--ckpt.path")


@pytest.fixture
def read_only_folder(tmp_path):
    """A folder on a read-only tmpfs (needs the right to mount; skipped without it)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_read_only_output_folder_is_one_line(tiny_model_dir, arithmetic_dir, read_only_folder):
    proc = run(CLI + flags(tiny_model_dir, arithmetic_dir, read_only_folder / "run"))
    assert proc.returncode == 2
    assert error_line(proc.stderr) == (
        f"posttrain sft: error: --ckpt.output_dir {read_only_folder / 'run'} cannot be written (it is on a "
        "read-only file system); choose a writable folder for --ckpt.output_dir")
