"""The role boundary: what the RL loop may ask of a role (ALGORITHMS-independent plumbing). Each
role owns its model and engine; fit / save_state / load_state / export / broadcast_weights behave
the same whatever placement implements them."""
import hashlib

import pytest
import torch
from test_rl_semantics import experience, settings

from posttrain.config.sections import AdamConfig, OptimizerFields
from posttrain.engines import make_train_engine
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout import HFRolloutEngine
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
    engine = make_train_engine(model, OptimizerFields(adam=AdamConfig(lr=1e-2)), total_steps=10)
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


def test_ema_of_a_checkpoint_without_ema_file_restarts_from_the_resumed_weights(tiny_model_dir, tmp_path):
    """A checkpoint without the EMA file: the EMA restarts from the resumed weights, never
    the initial ones."""
    tok = load_tokenizer(tiny_model_dir)
    a = actor(tiny_model_dir)
    a.fit(experience(tok), settings(3), 0.0, step=0)
    a.engine.save_state(tmp_path / "old")  # engine state only, no ema.pt
    c = actor(tiny_model_dir)
    c.load_state(tmp_path / "old")
    assert all(torch.equal(c.ema[k], v.float()) for k, v in c.model.state_dict().items())


def test_gspo_aggregates_only_its_policy_term_per_sequence(tiny_model_dir):
    """GSPO (OpenRLHF): the policy term per sequence, the entropy term a token mean. With the
    entropy term only (policy advantages 0), the gradient must equal token_mean's."""
    tok = load_tokenizer(tiny_model_dir)
    exp = experience(tok)
    exp.advantages = torch.zeros_like(exp.advantages)

    def grad(**kw):
        a = actor(tiny_model_dir, ema_beta=None)
        captured = {}
        a.engine.step = lambda: captured.update({k: p.grad.clone()
                                                 for k, p in a.model.named_parameters()}) or 0.0
        a.fit(exp, settings(6, entropy_coef=0.1, **kw), 0.0, step=0)
        return captured

    token = grad(loss_agg="token_mean")
    gspo = grad(loss_agg="token_mean", policy_loss_agg="seq_mean_token_mean", policy_loss_type="gspo")
    seq = grad(loss_agg="seq_mean_token_mean")
    for k in token:
        torch.testing.assert_close(gspo[k], token[k], atol=1e-7, rtol=1e-5)
    assert any(not torch.allclose(seq[k], token[k]) for k in token)
