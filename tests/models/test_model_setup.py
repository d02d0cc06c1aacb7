"""`models.setup`: one model set-up read from a run's config builds every role's model."""
from __future__ import annotations

import pytest
import torch

from posttrain.config import parse_config
from posttrain.models import LoraSpec, load_causal_lm
from posttrain.models.moe import take_router_loss
from posttrain.models.parallel_groups import ParallelLayout
from posttrain.models.setup import ModelSetup
from posttrain.trainers.rl import build
from posttrain.utils.errors import UserError

DS = ["--ds.param_dtype", "bf16", "--ds.attn_implementation", "eager", "--ds.no_onednn_linear",
      "--ds.experts_implementation", "batched_mm", "--ds.lora.rank", "4", "--ds.lora.alpha", "8",
      "--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "2", "--ds.tensor_parallel_size", "2"]
# what every loader call passed by hand before, from --ds
FROZEN = {"dtype": "bf16", "attn_implementation": "eager", "onednn_linear": False,
          "experts_implementation": "batched_mm"}
TRAINED = {**FROZEN, "lora": LoraSpec(rank=4, alpha=8, target_modules=["all-linear"]), "load_in_4bit": False,
           "gradient_checkpointing": True, "gradient_checkpointing_reentrant": True}


def _config(trainer: str, section: str):
    data = ["--data.prompt_dataset", "p"] if trainer == "ppo" else ["--data.dataset", "d"]
    head = ["--ds.value_head_prefix", "value_head"] if trainer in ("rm", "ppo") else []
    return parse_config(trainer, [f"--{section}.model_name_or_path", "m", *data, *DS,
                                  f"--{section}.gradient_checkpointing_enable",
                                  f"--{section}.gradient_checkpointing_reentrant",
                                  f"--{section}.aux_loss_coef", "0.01", *head], check=False)


@pytest.mark.parametrize("trainer,section",
                         [("sft", "model"), ("rm", "model"), ("dpo", "model"), ("ppo", "actor")])
def test_one_setup_from_each_trainers_config(trainer, section):
    setup = ModelSetup.of(_config(trainer, section))
    assert setup.load_kwargs(trained=True) == TRAINED
    assert setup.load_kwargs(trained=False) == FROZEN  # a frozen model: no LoRA, 4-bit or checkpointing
    assert setup.value_head_prefix == ("value_head" if trainer in ("rm", "ppo") else "score")
    assert setup.router_loss_coef == 0.01
    assert setup.router_loss_flag == f"--{section}.aux_loss_coef 0.01"
    assert (setup.ring, setup.head_stride, setup.tensor) == (2, 2, 2)
    assert setup.layout(8) == ParallelLayout(8, 2, 2)
    assert setup.layout(8, trained=False) == ParallelLayout(8, 2, 1)  # a frozen model is not tensor-parallel
    assert setup.layout(8, split_rows=False) == ParallelLayout(8, 1, 2)


def test_serve_rm_setup_has_no_trained_model():
    args = parse_config("serve-rm", ["--reward.model_name_or_path", "m", "--ds.param_dtype", "bf16",
                                     "--ds.value_head_prefix", "value_head"], check=False)
    setup = ModelSetup.of(args)
    assert setup.load_kwargs(trained=False)["dtype"] == "bf16"
    assert (setup.value_head_prefix, setup.lora, setup.ring) == ("value_head", None, 1)
    assert setup.router_loss_coef == 0.0


def test_roles_built_by_one_setup(tiny_model_dir, tiny_score_model_dir):
    setup = ModelSetup()
    policy = setup.build(tiny_model_dir, "policy")
    whole = sum(p.numel() for p in policy.model.parameters())
    assert policy.loaded_numel == (whole, whole) and not policy.sharded
    # the same weights as the loader gives by hand
    by_hand = load_causal_lm(tiny_model_dir)
    for (name, a), (_, b) in zip(policy.model.state_dict().items(), by_hand.state_dict().items()):
        assert torch.equal(a, b), name
    ref = setup.build(tiny_model_dir, "ref", device=torch.device("cpu"))
    assert not any(p.requires_grad for p in ref.model.parameters()) and not ref.model.training
    rollout = setup.build(tiny_model_dir, "rollout")  # keeps requires_grad as the actor's (same CPU kernels)
    assert all(p.requires_grad for p in rollout.model.parameters())
    actor = setup.build(tiny_model_dir, "actor")
    assert actor.model.training and actor.sync_only is None
    critic = setup.build(tiny_model_dir, "critic", new_head_ok=True)
    assert hasattr(critic.model, "score") and critic.model.training
    reward = setup.build(tiny_score_model_dir, "reward")
    assert hasattr(reward.model, "score")
    alone = setup.parallel(policy, rank=0, world=1)
    assert alone.layout == ParallelLayout(1) and alone.context is None


def test_router_loss_in_force(tiny_moe_dir, tiny_model_dir):
    setup = ModelSetup(router_loss_coef=0.01, router_loss_flag="--model.aux_loss_coef 0.01")
    built = setup.build(tiny_moe_dir, "policy")
    assert built.router_loss_coef == 0.01
    built.model(input_ids=torch.tensor([[1, 2, 3]]))
    assert take_router_loss(built.model) is not None
    assert setup.build(tiny_moe_dir, "ref").router_loss_coef == 0.0  # a frozen model has no router loss
    assert setup.build(tiny_model_dir, "critic", new_head_ok=True).router_loss_coef == 0.0  # a dense critic
    with pytest.raises(UserError, match="--model.aux_loss_coef 0.01: .* not a mixture of experts"):
        setup.build(tiny_model_dir, "policy")


def test_a_role_gets_its_model_parts_at_construction(tiny_model_dir):
    cfg = parse_config("ppo", ["--actor.model_name_or_path", tiny_model_dir, "--data.prompt_dataset", "p",
                               "--reward.remote_url", "r.py", "--ds.param_dtype", "fp32"], check=False)
    actor = build.build_actor(cfg, None, torch.device("cpu"), total_steps=1)
    whole = sum(p.numel() for p in actor.model.parameters())
    assert actor.loaded_numel == (whole, whole)
    assert actor.context is None and actor.sync_only is None
    ref = build.build_reference(cfg, None, torch.device("cpu"))
    assert ref.loaded_numel == (whole, whole) and ref.context is None
