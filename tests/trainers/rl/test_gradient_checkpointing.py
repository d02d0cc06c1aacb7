"""--actor.gradient_checkpointing_enable in RL: one training step of the actor, and of the critic
(which takes the actor's flags, as OpenRLHF), on long responses holds clearly less activation memory
at its peak, with the same loss and gradients."""
import pytest
import torch
from test_rl_semantics import settings

from posttrain.config import parse_config
from posttrain.config.sections import AdamConfig, OptimizerFields
from posttrain.engines import make_train_engine
from posttrain.models import load_causal_lm, load_score_model, load_tokenizer
from posttrain.rollout.single_turn import Rollout
from posttrain.trainers.rl.build import build_critic
from posttrain.trainers.rl.experience import build_experience
from posttrain.trainers.rl.roles import Actor, Critic
from posttrain.utils.memory import peak_memory

pytestmark = pytest.mark.usefixtures("one_torch_thread")
RESPONSE = 384


def long_experience(pad_id, rows=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    rolls = [Rollout(torch.randint(3, 300, (8,), generator=g).tolist(),
                     torch.randint(3, 300, (RESPONSE - 16 * i,), generator=g).tolist(),
                     [-1.0] * (RESPONSE - 16 * i), "length", "", "") for i in range(rows)]
    exp = build_experience(rolls, torch.zeros(rows), pad_id)
    exp.advantages = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    exp.values = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    exp.returns = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    return exp


def measured_step(role, fit):
    """(metrics, gradients, MemoryPeak) of one training step (after one unmeasured warm-up step); the
    optimizer step is replaced by taking the gradients, so the weights stay as loaded."""
    grads = {}

    def take_gradients():
        grads.clear()
        for name, p in role.model.named_parameters():
            grads[name], p.grad = p.grad, None
        return 0.0

    role.engine.step = take_gradients
    fit()
    metrics, peak = peak_memory(fit)
    return metrics, grads, peak


def compare(plain, checkpointed, loss_key):
    (m0, g0, p0), (m1, g1, p1) = plain, checkpointed
    assert m1[loss_key] == pytest.approx(m0[loss_key], abs=1e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)
    # the gradients themselves (the same in both) are part of each peak; the activations are not
    grad_bytes = sum(g.numel() * g.element_size() for g in g0.values())
    assert p1.peak_bytes - grad_bytes < 0.6 * (p0.peak_bytes - grad_bytes), (p0, p1, grad_bytes)


def test_actor_step_with_checkpointing_has_a_lower_peak_and_the_same_gradients(tiny_model_dir):
    exp = long_experience(load_tokenizer(tiny_model_dir).pad_token_id)

    def run(checkpointing):
        model = load_causal_lm(tiny_model_dir, gradient_checkpointing=checkpointing).train()
        engine = make_train_engine(model, OptimizerFields(adam=AdamConfig(lr=1e-3)), total_steps=2)
        actor = Actor(model, engine, 1.0, torch.device("cpu"))
        return measured_step(actor, lambda: actor.fit(exp, settings(2), 0.0, step=0))

    compare(run(False), run(True), "actor/policy_loss")


def test_critic_takes_the_actors_flag_and_its_step_has_a_lower_peak(tiny_model_dir, tiny_score_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    base = ["--actor.model_name_or_path", tiny_model_dir, "--critic.model_name_or_path", tiny_score_model_dir,
            "--reward.remote_url", "r.py", "--algo.advantage.estimator", "gae", "--ds.param_dtype", "fp32"]
    for flags, expected in (([], False), (["--actor.gradient_checkpointing_enable"], True)):
        critic = build_critic(parse_config("ppo", base + flags, check=False), tok, torch.device("cpu"), 2)
        model = critic.model
        on = (model.is_activation_checkpointing if hasattr(type(model), "is_activation_checkpointing")
              else model.is_gradient_checkpointing)  # the transformers >= 5 name
        assert on is expected
    exp = long_experience(tok.pad_token_id)

    def run(checkpointing):
        model = load_score_model(tiny_score_model_dir, gradient_checkpointing=checkpointing).train()
        engine = make_train_engine(model, OptimizerFields(adam=AdamConfig(lr=1e-3)), total_steps=2)
        critic = Critic(model, engine, torch.device("cpu"))
        return measured_step(critic, lambda: critic.fit(exp, settings(2), step=0))

    compare(run(False), run(True), "critic/value_loss")
