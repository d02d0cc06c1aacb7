"""The HF engine with a LoRA policy: adapter-only sync in both `lora_sync` modes samples with the
trainer's peft model (log-probs equal its recomputation), the hash covers base + adapter, merged keeps
the fast decode path and adapter falls back to transformers."""
import pytest
import torch

from posttrain.models import LoraSpec, apply_lora, is_peft, load_causal_lm
from posttrain.models import lora_sync as ls
from posttrain.models.cpu_linear import onednn_available
from posttrain.rollout import HFRolloutEngine, SamplingParams
from tests.rollout.test_rollout_hf import PROMPTS, recomputed_logprobs

SPEC = LoraSpec(rank=4, alpha=8)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    """The trainer's side: a peft policy whose adapter is not the identity."""
    torch.manual_seed(0)
    model = apply_lora(load_causal_lm(tiny_model_dir, dtype="fp32"), SPEC).eval()
    with torch.no_grad():
        for p in ls.adapter_params(model).values():
            p.normal_(0, 0.05)
    return model


def build(tiny_model_dir, tokenizer, mode):
    return HFRolloutEngine(load_causal_lm(tiny_model_dir, dtype="fp32").eval(), tokenizer,
                           pad_token_id=tokenizer.pad_token_id, lora=SPEC, lora_sync=mode)


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_adapter_sync_samples_with_the_trainers_weights(mode, policy, tiny_model_dir, tokenizer,
                                                        one_torch_thread):
    engine = build(tiny_model_dir, tokenizer, mode)
    assert engine.weights_hash() != ls.model_lora_hash(policy)
    sent = engine.load_weights(policy)  # the first (verified) sync: base + adapter
    assert sent == ls.pair_bytes(ls.base_pairs(policy)) + ls.adapter_bytes(policy)
    assert engine.weights_hash() == ls.model_lora_hash(policy)
    for seed in (1, 2):  # later syncs: the adapter only, never accumulated into the base
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in ls.adapter_params(policy).values():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        assert engine.sync_weights(policy) == ls.adapter_bytes(policy) < sent / 10
        assert engine.weights_hash() == ls.model_lora_hash(policy)
    params = SamplingParams(temperature=0.8, max_new_tokens=12, n=2, seed=3)
    outputs = [o for group in engine.generate(PROMPTS, params) for o in group]
    recomputed = recomputed_logprobs(policy, outputs, params.temperature)
    gap = max((torch.tensor(o.logprobs) - r).abs().max().item() for o, r in zip(outputs, recomputed))
    assert gap < 1e-5
    assert engine._fast is not None and engine._fast.usable()  # the fast decode path, adapter folded in
    if mode == "adapter":
        assert is_peft(engine.model)
        # peft wrapped the loaded copy's oneDNN linears (an nn.Linear subclass) as their base layers
        assert (any(type(m).__name__ == "OneDNNLinear" for m in engine.model.modules())
                or not onednn_available())
    with torch.no_grad():
        ls.adapter_params(policy)["model.layers.0.self_attn.q_proj.lora_B.weight"][0, 0] += 1e-3
    assert engine.weights_hash() != ls.model_lora_hash(policy)


def test_lora_engine_errors(policy, model, tokenizer, tiny_model_dir):
    plain = HFRolloutEngine(load_causal_lm(tiny_model_dir, dtype="fp32"), tokenizer, pad_token_id=0)
    with pytest.raises(ValueError, match="built without lora="):
        plain.sync_weights(policy)
    with pytest.raises(ValueError, match="lora_sync='x'"):
        HFRolloutEngine(model, tokenizer, pad_token_id=0, lora=SPEC, lora_sync="x")
    engine = build(tiny_model_dir, tokenizer, "adapter")
    with pytest.raises(KeyError, match="no adapter tensor named 'lm_head.lora_A.weight'"):
        engine.update_adapter([("lm_head.lora_A.weight", torch.zeros(4, 2))])
