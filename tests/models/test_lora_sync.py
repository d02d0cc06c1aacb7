"""Adapter-only sync (posttrain.models.lora_sync): canonical names, bytes, the merged view and the
hash over base + adapter on a peft tiny llama."""
import copy

import pytest
import torch

from posttrain.models import LoraSpec, apply_lora, load_causal_lm
from posttrain.models import lora_sync as ls
from posttrain.models.lora import base_name

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def peft_model(tiny_model_dir, one_torch_thread):
    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(tiny_model_dir), LoraSpec(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in ls.adapter_params(model).items():
            if name.endswith("lora_B.weight"):
                p.normal_(0, 0.05)  # peft starts B at zero
    return model


def randomise(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ls.adapter_params(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_canonical_names_and_bytes(peft_model, tiny_model_dir):
    layers = peft_model.config.num_hidden_layers
    names = [n for n, _ in ls.adapter_pairs(peft_model)]
    assert len(names) == 2 * len(PROJ) * layers
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert all(ls.is_adapter_name(n) and "default" not in n and "base_model" not in n for n in names)
    plain = load_causal_lm(tiny_model_dir).state_dict()
    base = dict(ls.base_pairs(peft_model))
    assert sorted(base) == sorted(plain) and all(torch.equal(base[n], plain[n]) for n in plain)
    assert ls.adapter_bytes(peft_model) == sum(p.numel() * p.element_size()
                                               for n, p in peft_model.named_parameters()
                                               if "lora_" in n)
    assert ls.scaling(peft_model) == 2.0
    assert base_name("base_model.model.score.modules_to_save.default.weight") == "score.weight"
    assert base_name("base_model.model.score.original_module.weight") is None


def test_merged_equals_merge_and_unload_and_never_accumulates(peft_model, tiny_model_dir):
    engine = load_causal_lm(tiny_model_dir)  # the engine's plain copy
    own = engine.state_dict()
    merged = ls.MergedBase(ls.scaling(peft_model))
    for name, _ in ls.adapter_pairs(peft_model):
        if name.endswith("lora_A.weight"):
            w = f"{ls.adapter_module(name)}.weight"
            merged.keep(w, own[w])
    pristine = {n: t.clone() for n, t in merged.base.items()}
    for seed in (1, 2, 3):
        randomise(peft_model, seed)
        pairs = ls.adapter_pairs(peft_model)
        updates = merged.receive(pairs[:5]) + merged.receive(pairs[5:])  # any split into buckets
        with torch.no_grad():
            for name, w in updates:
                own[name].copy_(w)
    assert all(torch.equal(merged.base[n], pristine[n]) for n in pristine)
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert max((own[n] - reference[n]).abs().max().item() for n in reference) < 1e-6
    # the engine's hash (W0 + adapter + s) equals the trainer's; one adapter element changes it
    assert merged.hash(engine.state_dict().items()) == ls.model_lora_hash(peft_model)
    with torch.no_grad():
        ls.adapter_params(peft_model)["model.layers.1.mlp.up_proj.lora_B.weight"][0, 0] += 1e-3
    assert merged.hash(engine.state_dict().items()) != ls.model_lora_hash(peft_model)


def test_hash_covers_base_adapter_and_scaling(peft_model):
    base, adapter, s = ls.base_pairs(peft_model), ls.adapter_pairs(peft_model), ls.scaling(peft_model)
    h = ls.lora_weights_hash(base, adapter, s)
    assert h == ls.model_lora_hash(peft_model)
    assert ls.lora_weights_hash(base, adapter, s * 2) != h
    bumped = [(n, t + (i == 0)) for i, (n, t) in enumerate(base)]
    assert ls.lora_weights_hash(bumped, adapter, s) != h


def test_merged_base_refuses_unknown_base_and_non_adapter_names():
    merged = ls.MergedBase(1.0)
    with pytest.raises(KeyError, match="not an adapter tensor"):
        merged.receive([("x.weight", torch.zeros(1))])
    with pytest.raises(KeyError, match="a full sync"):
        merged.receive([("m.lora_A.weight", torch.zeros(1, 2)), ("m.lora_B.weight", torch.zeros(2, 1))])


def test_a_new_base_is_merged_with_the_current_adapter():
    merged = ls.MergedBase(0.5)
    merged.keep("m.weight", torch.zeros(2, 3))
    a, b = torch.ones(1, 3), torch.full((2, 1), 2.0)
    (name, w), = merged.receive([("m.lora_A.weight", a), ("m.lora_B.weight", b)])
    assert name == "m.weight" and torch.equal(w, torch.ones(2, 3))
    assert torch.equal(merged.set_base("m.weight", torch.ones(2, 3)), torch.full((2, 3), 2.0))
    assert torch.equal(merged.base["m.weight"], torch.ones(2, 3))
