"""The role boundary: what the RL loop may ask of a role (ALGORITHMS-independent plumbing). Each
role owns its model and engine; fit / save_state / load_state / export / broadcast_weights behave
the same whatever placement implements them."""
import hashlib

import pytest
import torch
from test_rl_semantics import experience, settings

from posttrain.engines import make_train_engine
from posttrain.engines.rollout import HFRolloutEngine
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.trainers.rl.roles import Actor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def weights_hash(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def actor(tiny_model_dir, ema_beta=0.5):
    model = load_causal_lm(tiny_model_dir)
    engine = make_train_engine(model, optim="adam", lr=1e-2, total_steps=10, zero_stage=None, param_dtype="fp32")
    return Actor(model, engine, 1.0, torch.device("cpu"), ema_beta=ema_beta)


def test_actor_fit_state_round_trip_export_and_sync(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    exp = experience(tok)
    a = actor(tiny_model_dir)
    before = weights_hash(a.model)
    metrics = a.fit(exp, settings(3), 0.0, step=0)
    assert metrics["train/rows_per_step"] == 3 and weights_hash(a.model) != before
    a.save_state(tmp_path / "actor")
    after_fit, ema = weights_hash(a.model), {k: v.clone() for k, v in a.ema.items()}
    a.fit(exp, settings(3), 0.0, step=1)  # move on, then restore
    a.load_state(tmp_path / "actor")
    assert weights_hash(a.model) == after_fit
    assert all(torch.equal(a.ema[k], ema[k]) for k in ema)
    # the same state continues identically in a fresh role object
    b = actor(tiny_model_dir)
    b.load_state(tmp_path / "actor")
    a.fit(exp, settings(3), 0.0, step=1)
    b.fit(exp, settings(3), 0.0, step=1)
    assert weights_hash(a.model) == weights_hash(b.model)
    # export holds the EMA weights; broadcast makes a separate engine sample with the current weights
    a.export(tmp_path / "hf", tok)
    exported = load_causal_lm(tmp_path / "hf")
    torch.testing.assert_close(exported.state_dict()["lm_head.weight"].float(), a.ema["lm_head.weight"])
    engine = HFRolloutEngine(load_causal_lm(tiny_model_dir), tok, pad_token_id=tok.pad_token_id)
    assert weights_hash(engine.model) != weights_hash(a.model)
    a.broadcast_weights([engine])
    assert weights_hash(engine.model) == weights_hash(a.model)
