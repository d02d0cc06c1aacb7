"""The HF engine's fast decode step (rollout/cpu/fast_decode.py): the same samples and log-probs as
transformers' forward for llama and qwen2 through admissions, compaction and cache growth; its fused
weights follow every in-place weight change; hooks and unsupported models fall back to transformers."""
import copy

import pytest
import torch

from posttrain.models import build_tiny, load_causal_lm, load_tokenizer
from posttrain.rollout import HFRolloutEngine, SamplingParams
from posttrain.rollout.cpu import cpu_kernels
from posttrain.rollout.cpu.fast_decode import KVBuffer, fast_decoder

PROMPTS = [[5, 6, 7, 8], list(range(10, 31)), [40, 41], list(range(50, 59)), [60] * 13]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_model(request, tiny_model_dir, tmp_path_factory):
    if request.param == "llama":
        path = tiny_model_dir
    else:
        path = tmp_path_factory.mktemp("qwen2") / "m"
        build_tiny(str(path), arch="qwen2", size="nano", verbose=False)
    return load_causal_lm(str(path), dtype="fp32").eval(), load_tokenizer(str(path))


def _pair(model, tokenizer, kernels=True, **kw):
    """A fast-decode engine (with the fused CPU kernels where they build, or torch ops) and a plain one."""
    fast = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id, **kw)
    fast._fast = fast_decoder(model, kernels=kernels)
    plain = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id, fast_decode=False, **kw)
    assert fast._fast is not None and plain._fast is None
    assert (fast._fast.kernels is not None) == (kernels and cpu_kernels.load() is not None)
    return fast, plain


def _assert_same(a, b):
    for ga, gb in zip(a, b, strict=True):
        for x, y in zip(ga, gb, strict=True):
            assert x.output_token_ids == y.output_token_ids
            assert x.finish_reason == y.finish_reason
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-ops"])
def test_same_samples_as_transformers_forward(arch_model, kernels):
    """Continuous batching (3 rows at a time: rows join mid-generation, finished rows leave and columns
    are trimmed), per-prompt budgets up to 90 tokens (the cache grows past its spare columns) and a
    common stop id (rows finish early); with the fused CPU kernels and with torch ops."""
    model, tok = arch_model
    fast, plain = _pair(model, tok, kernels=kernels, batch_size=3)
    params = SamplingParams(temperature=0.8, top_p=0.95, n=2, seed=3, stop_token_ids=[])
    budgets = [90, 5, 40, 70, 12]
    probe = plain.generate(PROMPTS, params, max_new_tokens=budgets)
    stop = probe[3][1].output_token_ids[20]  # a token some row samples mid-way: it stops there
    # min_tokens 0: the draws this test was built on (with a ban at the first token a later draw lands on a
    # near-tie that the fused kernels and torch round apart)
    params = SamplingParams(temperature=0.8, top_p=0.95, n=2, seed=3, stop_token_ids=[stop], min_tokens=0)
    a = fast.generate(PROMPTS, params, max_new_tokens=budgets)
    b = plain.generate(PROMPTS, params, max_new_tokens=budgets)
    _assert_same(a, b)
    assert max(len(x.output_token_ids) for g in a for x in g) > 64  # the growth path ran
    assert len({x.finish_reason for g in a for x in g}) == 2


def test_fused_weights_follow_in_place_changes(arch_model):
    """An optimizer step changes the shared module in place between two generate calls: the fast
    path's fused copies are rebuilt (their key holds each weight's version counter)."""
    model, tok = arch_model
    model = copy.deepcopy(model)
    fast, plain = _pair(model, tok)
    params = SamplingParams(temperature=1.0, n=2, seed=5, max_new_tokens=12, stop_token_ids=[])
    _assert_same(fast.generate(PROMPTS, params), plain.generate(PROMPTS, params))
    before = fast.generate(PROMPTS, params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    after = fast.generate(PROMPTS, params)
    _assert_same(after, plain.generate(PROMPTS, params))
    assert [x.logprobs for g in after for x in g] != [x.logprobs for g in before for x in g]


@pytest.mark.parametrize("norm", ["model.layers.0.input_layernorm", "model.layers.1.post_attention_layernorm",
                                  "model.norm"])
def test_folded_norm_weights_follow_their_norms(arch_model, norm):
    """Each RMSNorm's weight is folded into the matmul after it: changing only that norm in place
    rebuilds the fused copy (the cache key holds the norms' versions too)."""
    model, tok = arch_model
    model = copy.deepcopy(model)
    fast, plain = _pair(model, tok)
    params = SamplingParams(temperature=1.0, n=2, seed=7, max_new_tokens=8, stop_token_ids=[])
    before = fast.generate(PROMPTS, params)
    with torch.no_grad():
        model.get_submodule(norm).weight.mul_(torch.linspace(0.5, 1.5, model.config.hidden_size))
    after = fast.generate(PROMPTS, params)
    _assert_same(after, plain.generate(PROMPTS, params))
    assert [x.logprobs for g in after for x in g] != [x.logprobs for g in before for x in g]


def test_hooks_and_unsupported_models_use_transformers_forward(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, dtype="fp32").eval()
    tok = load_tokenizer(tiny_model_dir)
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    seen = []
    batch = engine.decode_batch()
    assert batch._adopt == KVBuffer.from_cache
    hook = model.model.layers[0].mlp.register_forward_hook(lambda *a: seen.append(1))
    try:
        params = SamplingParams(n=1, seed=0, max_new_tokens=5, stop_token_ids=[])
        engine.generate([[5, 6, 7]], params)
        assert len(seen) == 5  # the prefill and 4 decode steps all ran the hooked module
    finally:
        hook.remove()
    for change in ({"pretraining_tp": 2}, {"_attn_implementation": "flash_attention_2"},
                   {"model_type": "gpt2"}):
        other = copy.deepcopy(model)
        for key, value in change.items():
            setattr(other.config, key, value)
        assert fast_decoder(other) is None, change


def test_reduced_precision_models_use_transformers_forward(tiny_model_dir):
    """In bf16 the folded norm weights and scalings would round differently from transformers' forward, so
    the fast path is fp32 only."""
    model = load_causal_lm(tiny_model_dir, dtype="fp32").eval()
    assert fast_decoder(model).usable()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the linears would compute in bf16
        assert not fast_decoder(model).usable()
    model = model.to(torch.bfloat16)
    assert not fast_decoder(model).usable()
    tok = load_tokenizer(tiny_model_dir)
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    assert engine.decode_batch()._adopt is not KVBuffer.from_cache


def test_kernels_are_skipped_where_the_rotary_halves_differ(tiny_model_dir):
    """The fused kernel rotates with one angle per pair of halves; a rotary module giving the halves
    different angles keeps the decode step on torch ops (which use the full cos / sin)."""
    if cpu_kernels.load() is None:
        pytest.skip("the CPU decode kernels do not load here")
    model = copy.deepcopy(load_causal_lm(tiny_model_dir, dtype="fp32").eval())
    rotary = model.model.rotary_emb

    class SkewedRotary(torch.nn.Module):
        def forward(self, x, position_ids):
            cos, sin = rotary(x, position_ids)
            return cos, sin * torch.linspace(0.5, 1.0, cos.shape[-1])

    model.model.rotary_emb = SkewedRotary()
    assert fast_decoder(model).kernels is None
    model.model.rotary_emb = rotary
    assert fast_decoder(model).kernels is not None


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-ops"])
def test_a_lora_model_decodes_fast_with_its_adapter_folded_in(tiny_model_dir, kernels):
    """peft's LoRA layers (all linear projections, non-zero B): the fast path folds W0 + s·B·A into its
    fused weights and samples as transformers' forward through the adapters does; it follows an in-place
    change of an adapter and `disable_adapter()` (the reference's base)."""
    from posttrain.models import apply_lora

    model = apply_lora(load_causal_lm(tiny_model_dir, dtype="fp32"), {"rank": 4, "alpha": 8}).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    tok = load_tokenizer(tiny_model_dir)
    hf = model.get_base_model()
    fast = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    fast._fast = fast_decoder(hf, kernels=kernels)
    plain = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id, fast_decode=False)
    assert fast._fast is not None and fast._fast.usable() and plain._fast is None
    params = SamplingParams(temperature=0.8, n=2, seed=3, max_new_tokens=16, stop_token_ids=[], min_tokens=0)
    _assert_same(fast.generate(PROMPTS, params), plain.generate(PROMPTS, params))
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.lora_B["default"].weight.mul_(3)
    _assert_same(fast.generate(PROMPTS, params), plain.generate(PROMPTS, params))
    with model.disable_adapter():
        base = fast.generate(PROMPTS, params)
        _assert_same(base, plain.generate(PROMPTS, params))
    assert base != fast.generate(PROMPTS, params)  # the adapter changes the samples
