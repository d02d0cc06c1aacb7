"""TorchEngine: gradient-sum contract, state round trip, factory choices and argument errors."""

import os
import subprocess
import sys

import pytest
import torch
from engines_common import (
    OPT,
    PLAN,
    make_data,
    merged,
    micro_loss,
    one_thread,  # noqa: F401
    run_step,
    step_tokens,
    tiny_llama,
    torch_engine,
    train_engine,
    weights,
)

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


def grads_and_weights(split):
    """Grads before the step and weights after it, for one step over samples 0..5 split as given."""
    data = make_data()
    engine = train_engine(tiny_llama(0), **OPT)
    total = step_tokens(data, {0: split})
    for mb in split:
        engine.backward(micro_loss(engine.model, data, mb, total))
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    norm = engine.step()
    return grads, weights(engine), norm


def test_accumulated_micro_batches_equal_one_batch():
    g1, w1, n1 = grads_and_weights([[0, 1, 2, 3, 4, 5]])
    gk, wk, nk = grads_and_weights([[0], [1, 2], [3, 4, 5]])
    for n in g1:
        torch.testing.assert_close(gk[n], g1[n], atol=1e-7, rtol=1e-5, msg=n)
        torch.testing.assert_close(wk[n], w1[n], atol=1e-6, rtol=0, msg=n)
    assert nk == pytest.approx(n1, rel=1e-6)
    # the returned norm is the pre-clip norm of the summed gradient
    assert n1 == pytest.approx(torch.linalg.vector_norm(torch.stack([g.norm() for g in g1.values()])).item(),
                               rel=1e-6)


def test_save_load_continues_identically(tmp_path):
    data = make_data()
    engine = train_engine(tiny_llama(0), **OPT)
    run_step(engine, data, merged(PLAN[0]), 0, pad=False)
    engine.save_state(str(tmp_path / "s"))
    for plan in PLAN[1:]:
        run_step(engine, data, merged(plan), 0, pad=False)
    fresh = train_engine(tiny_llama(7), **OPT)
    fresh.load_state(str(tmp_path / "s"))
    assert fresh.global_step == 1
    for plan in PLAN[1:]:
        run_step(fresh, data, merged(plan), 0, pad=False)
    w, wf = weights(engine), weights(fresh)
    assert all(torch.equal(w[k], wf[k]) for k in w)
    assert fresh.lr == engine.lr and fresh.global_step == engine.global_step == 3


def test_load_state_missing_or_corrupt_changes_nothing(tmp_path):
    engine = train_engine(tiny_llama(0), **OPT)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.load_state(str(tmp_path / "nope"))
    engine.save_state(str(tmp_path / "s"))
    other = train_engine(tiny_llama(5), **OPT)
    before = weights(other)
    path = tmp_path / "s" / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="optimizer.pt"):
        other.load_state(str(tmp_path / "s"))
    os.remove(path)
    with pytest.raises(FileNotFoundError, match="optimizer.pt"):
        other.load_state(str(tmp_path / "s"))
    (tmp_path / "s" / "engine_state.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        other.load_state(str(tmp_path / "s"))
    after = weights(other)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_factory_picks_torch_engine_without_importing_deepspeed():
    code = ("import sys, torch; from posttrain.engines import make_train_engine\n"
            "from posttrain.config.sections import AdamConfig, OptimizerFields\n"
            "e = make_train_engine(torch.nn.Linear(2, 2), OptimizerFields(adam=AdamConfig(lr=0.1)), "
            "total_steps=3)\nassert type(e).__name__ == 'TorchEngine' and e.rank == 0 and e.world_size == 1 "
            "and e.is_main\nassert 'deepspeed' not in sys.modules, 'deepspeed imported'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="adam_offload, overlap_comm"):
        train_engine(torch.nn.Linear(2, 2), lr=0.1, total_steps=3, adam_offload=True, overlap_comm=True)
    with pytest.raises(ValueError, match="param_dtype"):
        torch_engine(torch.nn.Linear(2, 2), lr=0.1, total_steps=3, param_dtype="fp16")
    with pytest.raises(ValueError, match="valid: linear, cosine,"):
        train_engine(torch.nn.Linear(2, 2), lr=0.1, total_steps=3, lr_scheduler="cosine_restart")


def test_single_process_helpers():
    engine = train_engine(torch.nn.Linear(2, 2), lr=0.1, total_steps=3)
    assert engine.max_across_ranks(3) == 3
    t = torch.tensor([2.0])
    assert engine.all_reduce(t, "max") is t and t.item() == 2.0
    with pytest.raises(ValueError, match="sum, max, min"):
        engine.all_reduce(t, "mean")
    engine.barrier()
    assert set(engine.full_state_dict()) == {"weight", "bias"}
    for per_tensor in (False, True):  # only the entries `keep` accepts, whole copies
        (pair,) = engine.full_weights(per_tensor, keep=lambda name: name == "bias")
        assert pair[0] == "bias" and torch.equal(pair[1], engine.module.bias.detach())
        assert pair[1].data_ptr() != engine.module.bias.data_ptr()


def _partly_frozen(seed: int):
    """tiny_llama(seed) with only its q_proj weights trainable (a LoRA model's shape of state)."""
    model = tiny_llama(seed)
    for name, p in model.named_parameters():
        p.requires_grad_("q_proj" in name)
    return model


def test_frozen_weights_stay_out_of_the_checkpoint_and_must_match_on_load(tmp_path):
    data = make_data()
    engine = train_engine(_partly_frozen(0), **OPT)
    run_step(engine, data, merged(PLAN[0]), 0, pad=False)
    engine.save_state(str(tmp_path / "s"))
    saved = torch.load(tmp_path / "s" / "model.pt", weights_only=True)
    assert saved and all("q_proj" in k for k in saved)
    fresh = train_engine(_partly_frozen(0), **OPT)
    fresh.load_state(str(tmp_path / "s"))
    w, wf = weights(engine), weights(fresh)
    assert all(torch.equal(w[k], wf[k]) for k in w)
    with pytest.raises(ValueError, match="other frozen"):
        train_engine(_partly_frozen(5), **OPT).load_state(str(tmp_path / "s"))
    # a checkpoint from before trainable-only checkpoints (model.pt holds every weight) still loads
    import json

    meta_path = tmp_path / "s" / "engine_state.json"
    meta = json.loads(meta_path.read_text())
    del meta["weights"], meta["frozen_hash"]
    meta_path.write_text(json.dumps(meta))
    torch.save(engine.module.state_dict(), tmp_path / "s" / "model.pt")
    old = train_engine(_partly_frozen(5), **OPT)
    old.load_state(str(tmp_path / "s"))
    assert all(torch.equal(v, w[k]) for k, v in weights(old).items())


def test_an_engine_state_of_another_layout_is_refused_naming_the_first_difference():
    """`TrainEngine.check_layout`: the ZeRO stage, then the world size, then the tensor-parallel size (a meta
    without one was written with none: 1) against the engine's own `layout`."""
    from posttrain.engines.base import TrainEngine

    engine = TrainEngine()
    engine.name, engine.zero_stage, engine.world_size, engine.tensor_parallel = "deepspeed", 2, 4, 2
    same = {"engine": "deepspeed", "zero_stage": 2, "world_size": 4, "tensor_parallel_size": 2}
    engine.check_layout("d", same)
    with pytest.raises(ValueError, match=r"^'d' was saved with world_size=2, this run has world_size=4: an "
                                         r"engine state resumes on the layout that wrote it$"):
        engine.check_layout("d", dict(same, world_size=2, tensor_parallel_size=1))
    with pytest.raises(ValueError, match=r"saved with tensor_parallel_size=None, this run has "
                                         r"tensor_parallel_size=2"):
        engine.check_layout("d", {k: v for k, v in same.items() if k != "tensor_parallel_size"})
    engine.tensor_parallel = 1
    engine.check_layout("d", {k: v for k, v in same.items() if k != "tensor_parallel_size"})
