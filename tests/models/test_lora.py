"""LoRA: only target modules get adapters, trainable counts match r·(in+out) per target,
the adapter starts as a no-op, saves as adapter files, and merges back exactly."""
import os
from types import SimpleNamespace

import pytest
import torch

from posttrain.models import (
    LoraSpec,
    as_lora_spec,
    forward_logits,
    load_causal_lm,
    load_tokenizer,
    merge_lora,
    save_pretrained,
)

IDS = torch.tensor([[5, 17, 230, 41, 9, 88]])


def expected_lora_params(config, rank, targets):
    """r·(in + out) for every targeted linear of every layer (A: r×in, B: out×r)."""
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return config.num_hidden_layers * sum(rank * sum(dims[t]) for t in targets)


def trainable(model):
    return {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}


def test_lora_targets_and_trainable_count(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, "fp32",
                           lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    names = trainable(model)
    assert names and all("lora_" in n and (".q_proj." in n or ".v_proj." in n) for n in names)
    assert sum(names.values()) == expected_lora_params(model.config, 4, ["q_proj", "v_proj"])
    assert sum(names.values()) == 7168  # nano: 4 layers · 4·((128+128) + (128+64))
    wrapped = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == 2 * model.config.num_hidden_layers
    assert {w.rsplit(".", 1)[-1] for w in wrapped} == {"q_proj", "v_proj"}


def test_lora_all_linear_excludes_lm_head(tiny_model_dir):
    spec = SimpleNamespace(rank=2, alpha=4, dropout=0.0, target_modules="all-linear")  # like cfg.ds.lora
    model = load_causal_lm(tiny_model_dir, "fp32", lora=spec)
    names = trainable(model)
    assert not any("lm_head" in n or "embed" in n for n in names)
    all_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert sum(names.values()) == expected_lora_params(model.config, 2, all_targets)


def test_lora_starts_as_identity_and_rank0_is_off(tiny_model_dir):
    base = load_causal_lm(tiny_model_dir, "fp32")
    assert as_lora_spec({"rank": 0}) is None and as_lora_spec(None) is None
    assert not hasattr(load_causal_lm(tiny_model_dir, "fp32", lora=LoraSpec(rank=0)), "peft_config")
    lora = load_causal_lm(tiny_model_dir, "fp32", lora=LoraSpec(rank=4, target_modules="q_proj,v_proj"))
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(lora, {"input_ids": IDS}),
                                   forward_logits(base, {"input_ids": IDS}), atol=0, rtol=0)


def test_lora_bad_specs(tiny_model_dir):
    with pytest.raises(ValueError, match=r"target_modules qkv: .*q_proj"):
        load_causal_lm(tiny_model_dir, "fp32", lora={"rank": 4, "target_modules": ["qkv"]})
    with pytest.raises(ValueError, match="unknown keys.*'r'"):
        as_lora_spec({"r": 4})
    with pytest.raises(ValueError, match="lora.rank=-1"):
        as_lora_spec({"rank": -1})


def test_lora_save_adapter_and_merge(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, "fp32",
                           lora={"rank": 4, "alpha": 8, "target_modules": "all-linear"})
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking adapter: B != 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
        want = forward_logits(model, {"input_ids": IDS})
    save_pretrained(model, tok, tmp_path / "adapter")
    files = set(os.listdir(tmp_path / "adapter"))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    merged = merge_lora(tmp_path / "adapter", tmp_path / "merged", base_path=tiny_model_dir)
    assert not hasattr(merged, "peft_config")
    reloaded = load_causal_lm(tmp_path / "merged", "fp32")
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(reloaded, {"input_ids": IDS}), want, atol=1e-5, rtol=0)


def test_gradient_checkpointing_with_lora_trains_adapters(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, "fp32", lora={"rank": 4, "target_modules": ["q_proj"]},
                           gradient_checkpointing=True, gradient_checkpointing_reentrant=True)
    model.train()
    assert model.get_base_model().model.gradient_checkpointing
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)
    forward_logits(model, {"input_ids": IDS}).logsumexp(-1).sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_load_in_4bit_without_a_gpu_says_why(tiny_model_dir):
    from posttrain.models import load_score_model

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the CPU refusal is what is tested here")
    for load in (load_causal_lm, load_score_model):
        with pytest.raises(ValueError, match="load_in_4bit.*CUDA GPU"):
            load(tiny_model_dir, "fp32", lora={"rank": 4}, load_in_4bit=True)


def test_trainable_names_are_the_adapter_tensors(tiny_model_dir):
    from posttrain.models import trainable_names

    model = load_causal_lm(tiny_model_dir, "fp32",
                           lora={"rank": 4, "alpha": 8, "target_modules": "all-linear"})
    assert trainable_names(model) == {n for n in model.state_dict() if "lora_" in n}


def test_an_adapter_on_a_tied_output_head_is_named(tiny_model_dir):
    from posttrain.models import tied_lora_layers

    head = load_causal_lm(tiny_model_dir, "fp32", lora={"rank": 4, "target_modules": ["q_proj", "lm_head"]})
    assert head.config.tie_word_embeddings and tied_lora_layers(head) == ["base_model.model.lm_head"]
    assert tied_lora_layers(load_causal_lm(tiny_model_dir, "fp32", lora={"rank": 4})) == []


def test_a_score_models_head_trains_fully_and_round_trips_through_the_adapter(tiny_model_dir, tmp_path,
                                                                              capsys):
    """LoRA on a critic / reward model: the start-up says the `score` head trains fully; the head has no
    adapter, its own weight changes in training, and base + saved adapter gives back the trained head (a fresh
    random head in the base is replaced by the saved one)."""
    from peft import PeftModel

    from posttrain.models import forward_values, load_score_model

    tok = load_tokenizer(tiny_model_dir)
    torch.manual_seed(0)
    model = load_score_model(tiny_model_dir, lora={"rank": 4, "target_modules": ["q_proj"]}, new_head_ok=True)
    assert "its head (score) trains fully" in capsys.readouterr().err
    head = model.base_model.model.score
    assert not any("score" in n and "lora_" in n for n, _ in model.named_parameters())
    before = head.modules_to_save["default"].weight.detach().clone()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        forward_values(model, {"input_ids": IDS}).square().mean().backward()
        opt.step()
    trained = head.modules_to_save["default"].weight.detach().clone()
    assert (trained - before).abs().max() > 1e-4
    with torch.no_grad():
        want = forward_values(model, {"input_ids": IDS})
    save_pretrained(model, tok, tmp_path / "adapter")
    torch.manual_seed(1)  # another random head in the base
    base = load_score_model(tiny_model_dir, new_head_ok=True)
    assert (base.score.weight - trained).abs().max() > 1e-4
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(reloaded.base_model.model.score.modules_to_save["default"].weight, trained)
    with torch.no_grad():
        torch.testing.assert_close(forward_values(reloaded, {"input_ids": IDS}), want, atol=1e-6, rtol=0)


def test_a_rank_above_a_moe_gate_but_within_the_other_layers_adapts_them_all_with_a_note(capsys):
    """Qwen2-MoE's shared-expert gate is hidden -> 1: rank 8 all-linear must not be refused for it (only a
    rank above every adapted layer is); the note names the narrow gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from posttrain.models.lora import LoraError, apply_lora

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = apply_lora(Qwen2MoeForCausalLM(config), LoraSpec(rank=8))
    gates = [n for n, p in model.named_parameters() if "shared_expert_gate.lora_A" in n]
    assert gates and all(model.get_parameter(n).shape == (8, 32) for n in gates)
    assert "note: --ds.lora.rank 8 exceeds min(in, out) of shared_expert_gate;" in capsys.readouterr().err
    with pytest.raises(LoraError, match=r"--ds.lora.rank 33 exceeds every layer it adapts \(the largest, "
                                        r".*: 32 -> \d+\).*use --ds.lora.rank 32 or less"):
        apply_lora(Qwen2MoeForCausalLM(config), LoraSpec(rank=33))
