"""Mixture-of-experts models (`models.moe`): the router load-balancing loss by hand and as the model family
computes it, the expert blocks found for ZeRO-3, the tiny MoE, and the flags' errors."""
import math

import pytest
import torch

from posttrain.models import load_causal_lm
from posttrain.models.moe import expert_block_classes, is_moe, take_router_loss, track_router_loss
from posttrain.utils.errors import UserError


def test_load_balancing_loss_by_hand():
    """2 tokens, 4 experts, top 2. Token A: probabilities (4, 2, 1, 1)/8 -> experts 0, 1; token B: (1, 2, 4,
    1)/8 -> experts 2, 1. Slot shares: slot 0 picks e0 and e2 half the time each, slot 1 always e1; mean
    probabilities (0.3125, 0.25, 0.3125, 0.125). Loss = 4 x (0.5 x 0.3125 + 0.5 x 0.3125 + 1 x
    0.25) = 2.25."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.log(torch.tensor([[4.0, 2.0, 1.0, 1.0], [1.0, 2.0, 4.0, 1.0]]))
    assert float(load_balancing_loss_func((logits,), 4, 2)) == pytest.approx(2.25, abs=1e-6)


def test_the_tracked_loss_is_the_familys_on_the_models_own_router_logits(tiny_moe_dir):
    """The hook's loss equals transformers' load_balancing_loss_func on the router logits the model returns,
    with the padding of a 2-D attention mask left out; the loss is taken once."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load_causal_lm(tiny_moe_dir)
    assert is_moe(model) and [c.__name__ for c in expert_block_classes(model)] == ["Qwen3MoeSparseMoeBlock"]
    track_router_loss(model)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    want = load_balancing_loss_func(out.router_logits, 4, 2, mask)
    got = take_router_loss(model)
    assert got is not None and float(got.detach()) == pytest.approx(float(want), rel=1e-6)
    # mask
    assert float(got.detach()) != pytest.approx(float(load_balancing_loss_func(out.router_logits, 4, 2)),
                                                rel=1e-4)
    assert got.requires_grad and take_router_loss(model) is None
    assert 1.0 <= float(got.detach()) <= 4.0  # E x sum f_e P_e: 1 when balanced


def test_a_dense_model_has_no_router_loss(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    assert not is_moe(model) and expert_block_classes(model) == []
    with pytest.raises(UserError, match=r"--model.aux_loss_coef 0.01: LlamaForCausalLM is not a mixture of "
                                        r"experts"):
        track_router_loss(model, "--model.aux_loss_coef 0.01")


def test_experts_implementation_is_applied_and_refused_where_it_cannot_act(tiny_moe_dir, tiny_model_dir):
    from posttrain.models.loading import ModelLoadError

    model = load_causal_lm(tiny_moe_dir, experts_implementation="eager")
    assert model.config._experts_implementation == "eager"
    base = load_causal_lm(tiny_moe_dir)
    ids = torch.randint(3, 200, (1, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelLoadError, match="is not a mixture of experts"):
        load_causal_lm(tiny_model_dir, experts_implementation="eager")


def test_init_tiny_moe_has_the_dense_presets_active_size(tiny_moe_dir, tiny_model_dir):
    """4 experts of half the MLP width, 2 per token: the active MLP parameters of the dense nano preset."""
    import json
    from pathlib import Path

    moe = json.loads((Path(tiny_moe_dir) / "config.json").read_text())
    dense = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    # transformers saves num_experts so
    assert moe["num_local_experts"] == 4 and moe["num_experts_per_tok"] == 2
    assert moe["moe_intermediate_size"] * moe["num_experts_per_tok"] == dense["intermediate_size"]
    assert math.isclose(moe["hidden_size"], dense["hidden_size"])
