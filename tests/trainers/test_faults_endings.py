"""How real `posttrain sft` processes end in the corners of the run lifecycle (issue 46): Ctrl-C pressed
twice, a fresh start under --ckpt.load_enable, resuming a finished run into a new output folder.
Same set-up as test_faults.py (the nano model, 16 samples in batches of 4: 4 steps per epoch); the runs
that end normally (a resume, a fresh start) run in this process (`sft_here`), the endings checked by their
exit status in processes of their own."""
import sys

import pytest
from safetensors.torch import load_file
from test_faults import CLI, flags, run, sft_here, trained

from posttrain.utils.checkpoint import verify_checkpoint
from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e

DRIVER_CTRL_C_TWICE = """
import atexit, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C's default, also under a background runner
import posttrain.utils.checkpoint as checkpoint
from posttrain.engines.torch_engine import TorchEngine

def press():  # Ctrl-C; a handler that raises does so before the sleep ends
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)

save_state, calls = TorchEngine.save_state, []
def pressed_while_saving(self, directory):
    calls.append(directory)
    if len(calls) == 3:  # step 3's checkpoint, half written, when Ctrl-C is pressed
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "model.pt"), "wb") as f:
            f.write(b"partial")
        press()
    return save_state(self, directory)
TorchEngine.save_state = pressed_while_saving

disk_full_reason = checkpoint.disk_full_reason
def pressed_again(err, tmp):  # the first thing the save's clean-up does: Ctrl-C again
    press()
    return disk_full_reason(err, tmp)
checkpoint.disk_full_reason = pressed_again
atexit.register(press)  # and a third time while the process ends
from posttrain.cli.main import main
sys.argv = ["posttrain", "sft", *sys.argv[1:]]
main()  # the console command (main(argv) is an in-process call, which gets its handlers back)
"""


def test_ctrl_c_pressed_again_during_the_clean_up_ends_the_same_way(tiny_model_dir, arithmetic_dir, tmp_path,
                                                                   capfd):
    """The first Ctrl-C decides the ending (exit 2, one line); the second (during the interrupted save's
    clean-up) is ignored: the half-written checkpoint is removed and the last complete one resumes; the
    third (while the process ends) ends it at once, with the same status."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    args = flags(tiny_model_dir, arithmetic_dir, out, "--ckpt.save_steps", 1, "--train.max_epochs", 2)
    proc = run([sys.executable, "-c", DRIVER_CTRL_C_TWICE, *args])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("[posttrain] stopping: the clean-up is running") == 1  # the second press
    assert [line for line in proc.stderr.splitlines() if line.strip()][-2:] == [
        f"posttrain sft: error: interrupted at step 3; last checkpoint: {ckpt / 'global_step2'}",
        "[posttrain] SIGINT a third time: exiting at once, the clean-up unfinished"]
    left = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".posttrain"))  # not the lock
    assert left == ["global_step1", "global_step2"]
    assert verify_checkpoint(ckpt / "global_step2") is None
    resumed = sft_here(capfd, [*args, "--ckpt.load_enable"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'global_step2'} at step 2" in resumed.stderr


def test_a_fresh_start_under_load_enable_rewinds_the_metrics_file(tiny_model_dir, arithmetic_dir, tmp_path,
                                                                  capfd):
    """--ckpt.load_enable with no checkpoint left that verifies starts fresh: the metrics file starts over
    too, as a resume cuts it back to the checkpoint's step (no step logged twice)."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    trained(flags(tiny_model_dir, arithmetic_dir, out, "--ckpt.save_steps", 2))
    for step in ckpt.glob("global_step*"):
        (step / "trainer_rank0.pt").write_bytes(b"torn")  # no longer verifies
    proc = sft_here(capfd, flags(tiny_model_dir, arithmetic_dir, out, "--ckpt.save_steps", 2,
                                 "--ckpt.load_enable"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"no valid checkpoint in {ckpt}; starting fresh" in proc.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3, 4]


def test_resuming_a_finished_run_into_a_new_output_folder_writes_its_final_model(
        tiny_model_dir, arithmetic_dir, tmp_path, capfd):
    """The checkpoint of a run's last step, resumed with another --ckpt.output_dir: nothing is left to train,
    so the run says so and writes the final model (the checkpoint's weights) to the new folder."""
    first, new = tmp_path / "first", tmp_path / "new"
    trained(flags(tiny_model_dir, arithmetic_dir, first, "--ckpt.save_steps", 2))
    proc = sft_here(capfd, flags(tiny_model_dir, arithmetic_dir, new, "--ckpt.path", first / "checkpoints",
                                 "--ckpt.save_steps", 2, "--ckpt.load_enable"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error" not in proc.stderr.splitlines()[-1]
    assert f"{first / 'checkpoints' / 'global_step4'} is at the run's last step (4)" in proc.stderr
    ours, theirs = load_file(str(new / "model.safetensors")), load_file(str(first / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)


def test_resuming_another_runs_checkpoints_over_a_finished_run_is_refused(tiny_model_dir, arithmetic_dir,
                                                                          tmp_path, capfd):
    """--ckpt.load_enable with a --ckpt.path holding another run's checkpoints does not replace the finished
    run in --ckpt.output_dir (one line, exit 2, its files unchanged); a finished run's own checkpoints, at
    the --ckpt.path its config.yaml records, still resume."""
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    own = ("--ckpt.path", ckpt, "--ckpt.save_steps", 2)
    trained(flags(tiny_model_dir, arithmetic_dir, first, *own))
    trained(flags(tiny_model_dir, arithmetic_dir, second))
    files = lambda: {p.name: p.read_bytes() for p in second.iterdir() if p.is_file()}  # noqa: E731
    before = files()
    proc = run(CLI + flags(tiny_model_dir, arithmetic_dir, second, *own, "--ckpt.load_enable"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"posttrain sft: error: --ckpt.output_dir {second} holds a finished run (summary.json) and "
        f"--ckpt.path {ckpt} is not its checkpoint folder (resuming another run's would replace it); "
        "replace it with --ckpt.overwrite, or choose another --ckpt.output_dir")
    assert files() == before
    again = sft_here(capfd, flags(tiny_model_dir, arithmetic_dir, first, *own, "--ckpt.load_enable"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{ckpt / 'global_step4'} is at the run's last step (4)" in again.stderr
