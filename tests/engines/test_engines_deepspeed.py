"""DeepSpeed ZeRO 0-3 (and the data-parallel TorchEngine) with 2 CPU processes (gloo) reproduce the
single-process TorchEngine run.

One torchrun launch runs every stage on the shared PLAN (ranks with different micro-batch counts,
padded under ZeRO-2/3) and a save/load round trip under ZeRO-2 and ZeRO-3.
"""

import os
import socket
import subprocess
import sys

import pytest
import torch
from engines_common import (
    OPT,
    PLAN,
    make_data,
    merged,
    one_thread,  # noqa: F401
    run_step,
    tiny_llama,
    train_engine,
    weights,
)
from rounding import adam_weight_tolerance

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread")]
HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = (0, 1, 2, 3, -1)  # -1: TorchEngine, data parallel over gloo


@pytest.fixture(scope="module")
def ds_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds")
    out = tmp / "out.pt"
    with socket.socket() as sock:  # torchrun's --master_port 0 does not reach the workers' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           os.path.join(HERE, "engines_ds_worker.py"), str(out), str(tmp), ",".join(map(str, STAGES)), "2,3"]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference():
    """The same steps in one process, one micro-batch per step."""
    data = make_data()
    engine = train_engine(tiny_llama(0), **OPT)
    ref = {"w": [], "norms": [], "lrs": []}
    for plan in PLAN:
        ref["lrs"].append(engine.lr)
        ref["norms"].append(run_step(engine, data, merged(plan), 0, pad=False))
        ref["w"].append(weights(engine))
    return ref


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_reference_clips_some_steps(reference):
    norms = reference["norms"]
    assert norms[0] < OPT["max_norm"] < max(norms)  # both the clipped and the unclipped path are exercised


@pytest.mark.parametrize("stage", STAGES)
def test_zero_weights_match_single_process(ds_results, reference, stage):
    res = ds_results[stage]
    for step in range(len(PLAN)):
        # the ranks sum the gradients in another order: rounding as Adam at OPT's lr and eps passes it on
        # (rounding.py; betas (0.9, 0.95) also keep |m| <= 1.01 sqrt(v) over these steps); a wrong scale
        # shows in the norms
        bound = adam_weight_tolerance(OPT["lr"], reference["norms"][:step + 1], OPT["eps"], OPT["max_norm"])
        diff = max_diff(res["w"][step], reference["w"][step])
        print(f"stage {stage} step {step}: weights differ by {diff:.3g}, rounding bound {bound:.3g}")
        assert diff < bound, f"stage {stage} step {step}: {diff:.3g} >= {bound:.3g}"
        assert res["norms"][step] == pytest.approx(reference["norms"][step], rel=1e-5)
        assert res["lrs"][step] == pytest.approx(reference["lrs"][step], rel=1e-9)


@pytest.mark.parametrize("stage", (2, 3))
def test_zero_save_load_continues_identically(ds_results, stage):
    res = ds_results[stage]
    assert res["resumed_step"] == 1
    for j, w in enumerate(res["resumed_w"]):
        assert max_diff(w, res["w"][j + 1]) == 0.0
    assert "does-not-exist" in res["missing_error"]


FROZEN_ROUND_TRIP = """
import json, sys
import torch
from engines_common import OPT, PLAN, make_data, merged, run_step, tiny_llama, train_engine, weights

def partly_frozen(seed):
    model = tiny_llama(seed)
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name)
    return model

out, data = sys.argv[1], make_data()
engine = train_engine(partly_frozen(0), zero_stage=2, **OPT)
run_step(engine, data, merged(PLAN[0]), 0, pad=False)
engine.save_state(out)
run_step(engine, data, merged(PLAN[1]), 0, pad=False)
fresh = train_engine(partly_frozen(0), zero_stage=2, **OPT)
fresh.load_state(out)
run_step(fresh, data, merged(PLAN[1]), 0, pad=False)
w, wf = weights(engine), weights(fresh)
refused = ""
try:
    train_engine(partly_frozen(5), zero_stage=2, **OPT).load_state(out)
except ValueError as e:
    refused = str(e)
print(json.dumps({"diff": max(float((w[k] - wf[k]).abs().max()) for k in w), "refused": refused}))
"""


def test_frozen_weights_stay_out_of_a_zero2_checkpoint(tmp_path):
    """One DeepSpeed rank (a subprocess: its process group stays out of this one): a model with frozen
    parameters (LoRA's shape) saves its trainable tensors only, resumes exactly, and refuses another base."""
    import json

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", FROZEN_ROUND_TRIP, str(tmp_path / "s")], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["diff"] == 0.0 and "other frozen" in result["refused"]
    meta = json.loads((tmp_path / "s" / "engine_state.json").read_text())
    assert meta["weights"] == "trainable" and meta["frozen_hash"]
    states = torch.load(tmp_path / "s" / "engine" / "mp_rank_00_model_states.pt",
                        weights_only=False)["module"]
    assert states and all("q_proj" in k for k in states)


def test_the_gradient_reduce_bucket_fits_the_trainable_elements():
    """DeepSpeed allocates its reduce bucket whole on every rank (5e8 elements by default: 1.9 GB in fp32):
    ZeRO-2/3 get one of 1/8 of the trainable elements, at least 1e6 and at most 5e7."""
    from posttrain.engines.deepspeed_engine import ds_config

    def bucket(stage, trainable):
        zero = ds_config(zero_stage=stage, world_size=2, max_norm=1.0,
                         trainable=trainable)["zero_optimization"]
        return zero.get("reduce_bucket_size")

    assert (bucket(3, 325_632) == 1_000_000 and bucket(2, 10_199_424) == 1_274_928
            and bucket(3, 200_000_000) == 25_000_000)
    assert bucket(3, 494_032_768) == 50_000_000 and bucket(3, None) == 50_000_000
    assert bucket(1, 10_199_424) is None and bucket(0, 10_199_424) is None
