"""The RL trainer's checkpoints: a live run's checkpoint folder is locked against a second run, a
resume rewinds samples.jsonl to the checkpoint's step, and a crafted trainer_state.pt is refused
without being unpickled."""
import json
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from rl_runs import ppo_flags

from posttrain.cli import train_ppo_ray
from posttrain.utils.checkpoint import MANIFEST, _crc32, verify_checkpoint

pytestmark = pytest.mark.slow

HOLD = ("import sys, time; from posttrain.utils.run_lock import RunLock; "
        "lock = RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)")


def test_a_checkpoint_folder_held_by_another_run_is_refused(rl_setup, tmp_path, capsys):
    ckpt = tmp_path / "other_run" / "checkpoints"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(ckpt)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(SystemExit) as e:
            train_ppo_ray.main(ppo_flags(rl_setup, tmp_path / "mine", "--ckpt.path", ckpt,
                                         "--ckpt.load_enable"))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert e.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"posttrain ppo: error: --ckpt.path {ckpt} is in use by another posttrain run "
                           f"(pid {holder.pid}, started ")


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_resume_rewinds_samples_and_refuses_a_crafted_state_file(rl_setup, tmp_path, capsys):
    out, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    short = ["--train.num_episodes", "1", "--data.max_samples", "32", "--ckpt.save_steps", "2",
             "--ckpt.max_num", "4"]
    train_ppo_ray.main(ppo_flags(rl_setup, out, *short))  # 4 steps, checkpoints 2 and 4
    steps = lambda: [json.loads(line)["step"] for line in (out / "samples.jsonl").read_text().splitlines()]
    assert steps() == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    shutil.rmtree(ckpt / "global_step4")  # as if the run had died before saving step 4
    train_ppo_ray.main(ppo_flags(rl_setup, out, *short, "--ckpt.load_enable"))
    assert steps() == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4  # steps 3-4 once, not twice

    step = ckpt / "global_step4"
    state, marker = step / "trainer_state.pt", tmp_path / "code_ran"
    torch.save({"rng": RunsCode(marker)}, state)
    manifest = json.loads((step / MANIFEST).read_text())  # the CRC recomputed: the file verifies
    manifest["files"]["trainer_state.pt"] = [state.stat().st_size, _crc32(state)]
    (step / MANIFEST).write_text(json.dumps(manifest))
    assert verify_checkpoint(step) is None
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train_ppo_ray.main(ppo_flags(rl_setup, out, *short, "--ckpt.load_enable"))
    assert e.value.code == 2 and not marker.exists()
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        f"posttrain ppo: error: checkpoint file {state} holds objects other than tensors and plain values")
