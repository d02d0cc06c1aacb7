"""Helpers shared by the SFT trainer tests."""
import pytest
import torch
from rewards_http import free_port
from rounding import NORM_REL, adam_weight_tolerance, assert_weights_within
from safetensors.torch import load_file

from posttrain.utils.metrics import read_metrics


def sft_flags(model_dir, data_dir, out_dir, *extra) -> list[str]:
    return ["--model.model_name_or_path", str(model_dir), "--data.dataset", str(data_dir),
            "--data.input_key", "prompt", "--data.output_key", "response", "--data.apply_chat_template",
            "--data.max_len", "48", "--train.batch_size", "8", "--train.micro_batch_size", "8",
            "--train.max_epochs", "1", "--adam.lr", "1e-3", "--ckpt.output_dir", str(out_dir),
            "--eval.dataset", str(data_dir), "--eval.split", "test", "--logger.logging_steps", "1",
            *map(str, extra)]


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def assert_same_weights(a, b, atol=1e-6):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)


def assert_weights_within_rounding(want, got, lr: float = 1e-3) -> None:
    """The runs `want` and `got` (run dirs, trained at `lr` with `--adam.eps` ADAM_EPS and a metrics row per
    optimizer step) exported the same tensors up to the rounding Adam passes on (rounding.py), with the
    gradient norms that `want` logged."""
    norms = [r["train/grad_norm"] for r in read_metrics(want / "metrics.jsonl") if "train/grad_norm" in r]
    assert norms, f"no train/grad_norm in {want / 'metrics.jsonl'}"
    assert_weights_within(weights(want), weights(got), adam_weight_tolerance(lr, norms))


def assert_same_grad_norms(want, got) -> None:
    """The runs `want` and `got` (run dirs) logged the same gradient norm (before clipping) at every step, up
    to rounding (NORM_REL): a gradient of the wrong scale shows here even where clipping hides it
    from the weights."""
    norms = [[r["train/grad_norm"] for r in read_metrics(d / "metrics.jsonl") if "train/grad_norm" in r]
             for d in (want, got)]
    assert len(norms[1]) == len(norms[0]) > 0 and norms[1] == pytest.approx(norms[0], rel=NORM_REL), norms


def torchrun(module: str, flags, nproc: int = 2):
    """`python -m torch.distributed.run --nproc_per_node nproc -m module *flags` on CPU (gloo) on a
    free port; the finished process (asserted to have exited 0)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    port = str(free_port())  # (torchrun's --master_port 0 does not reach the workers)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", port, "-m", module, *map(str, flags)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


class CaseRun:
    """One case of `torchrun_cases`: its exit status (nonzero when any rank's is) and its ranks' stderr (in
    rank order)."""

    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr = returncode, stderr

    def ok(self) -> "CaseRun":
        """Itself, asserted to have exited 0 (as `torchrun` asserts)."""
        assert self.returncode == 0, self.stderr[-4000:]
        return self


def torchrun_cases(cases, folder, nproc: int = 2, timeout: int = 600) -> list[CaseRun]:
    """Each of `cases` ((module, flags) or (module, flags, copies)) run as `torchrun(module, flags, nproc)`
    runs it, one after another in one launch (launch_cases.py: the start-up and imports paid once); `copies`:
    (source, target) folders copied before the case runs (an earlier case's checkpoint it resumes); `folder`
    keeps the logs. A launch still running after `timeout` s is killed with all its processes, and the
    failure names where each case's ranks stood."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    assert not any(folder.glob("case*")), f"{folder}: holds an earlier launch's files; give a fresh folder"
    spec = [{"module": module, "flags": [str(f) for f in flags], "log": str(folder / f"case{i}"),
             "copies": [[str(source), str(target)] for source, target in (copies[0] if copies else ())]}
            for i, (module, flags, *copies) in enumerate(cases)]
    (folder / "cases.json").write_text(json.dumps(spec))
    port = str(free_port())  # the launch's (each case's own: launch_cases.case_port)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           port, str(Path(__file__).with_name("launch_cases.py")), str(folder / "cases.json")]
    launch = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, stderr = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_launch(launch)
        try:
            stderr = launch.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:  # a survivor holds the pipes: report without torchrun's stderr
            stderr = ""
        raise AssertionError(f"the launch ran over {timeout} s; where its cases stood:\n"
                             + "\n".join(case_state(case["log"], nproc) for case in spec)
                             + f"\ntorchrun's stderr ends:\n{stderr[-2000:]}") from None
    except BaseException:  # Ctrl-C, pytest's own timeout: nothing of the launch outlives the test
        kill_launch(launch)
        raise
    assert launch.returncode == 0, stderr[-4000:]
    runs = []
    for case in spec:
        logs = [Path(f"{case['log']}.rank{r}") for r in range(nproc)]
        codes = [int(Path(f"{log}.exit").read_text()) for log in logs]
        runs.append(CaseRun(next((c for c in codes if c), 0), "".join(log.read_text() for log in logs)))
    return runs


def kill_launch(launch) -> None:
    """SIGKILL a torchrun launch and everything it started: each rank's session (torchrun starts every rank
    in a session of its own, with the cases it forks), whatever else descends from it, then the agent."""
    import contextlib
    import os
    import signal

    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        tree = psutil.Process(launch.pid).children(recursive=True)
        for rank in psutil.Process(launch.pid).children():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rank.pid, signal.SIGKILL)
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    launch.kill()


def case_state(log: str, nproc: int) -> str:
    """One case of a launch that hung: its store's port (launch_cases.case_port) and per rank its exit status
    (or none when the launch was killed), and its log's last lines."""
    from pathlib import Path

    port = Path(f"{log}.port")
    lines = [f"{Path(log).name}: port {port.read_text() if port.exists() else '(not picked)'}"]
    for rank in range(nproc):
        path, done = Path(f"{log}.rank{rank}"), Path(f"{log}.rank{rank}.exit")
        state = (f"exit {done.read_text()}" if done.exists() else
                 "no exit status" if path.exists() else "not started")
        tail = path.read_text(errors="replace").splitlines()[-5:] if path.exists() else []
        lines.append(f"  rank {rank}: {state}" + "".join(f"\n    {t}" for t in tail))
    return "\n".join(lines)


def assert_loaded_as_shards(stderr: str, role: str, nproc: int = 2) -> None:
    """Every rank reported (`[rank R] {role}: loaded as ZeRO-3 shards: this rank holds A M of B M`)
    holding about its 1/nproc share of `role`'s parameters, and the shares cover the whole model
    (the figures are printed to 0.01M)."""
    import re

    found = re.findall(rf"\[rank (\d+)\] {re.escape(role)}: loaded as ZeRO-3 shards: this rank holds "
                       r"([\d.]+)M of ([\d.]+)M parameters", stderr)
    shares = {int(rank): (float(own), float(full)) for rank, own, full in found}
    assert (sorted(shares) == list(range(nproc))), (f"{role}: shard reports of ranks "
                                                    f"{sorted(shares)}\n{stderr[-3000:]}")
    full = shares[0][1]
    assert full > 0 and all(f == full for _, f in shares.values())
    assert all(own < 1.2 / nproc * full for own, _ in shares.values()), shares
    assert sum(own for own, _ in shares.values()) >= full - 0.01 * nproc, shares
