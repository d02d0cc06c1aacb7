"""oneDNN fp32 linear layers on CPU (models/cpu_linear.py): the same outputs and gradients as `F.linear`
up to float rounding, torch's own `F.linear` wherever oneDNN does not apply, and models loaded with or
without it train and sample alike."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import cpu_linear, load_causal_lm, load_score_model, load_tokenizer
from posttrain.models.cpu_linear import (
    OneDNNLinear,
    onednn_available,
    onednn_linear,
    packed_linear,
    packed_weight,
    takes_onednn,
    use_onednn_linears,
    worth_onednn,
    worth_packing,
)
from posttrain.rollout import HFRolloutEngine, SamplingParams

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _grads(fn, *tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [None if t.grad is None else t.grad.clone() for t in tensors]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (3, 11, 48)])
def test_outputs_and_gradients_equal_f_linear(bias, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(40, 48, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    leaves = [x, w] + ([b] if bias else [])
    assert takes_onednn(x, w)
    ref, ref_grads = _grads(lambda: F.linear(x, w, b), *leaves)
    out, grads = _grads(lambda: onednn_linear(x, w, b), *leaves)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(w.grad, torch.zeros_like(w))


def test_non_contiguous_input_and_frozen_weight():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(11, 3, 48, generator=g, requires_grad=True)
    x = base.transpose(0, 1)  # [3, 11, 48], not contiguous
    w = torch.randn(40, 48, generator=g)  # frozen: no weight gradient is computed
    ref, (ref_grad,) = _grads(lambda: F.linear(x, w), base)
    out, (grad,) = _grads(lambda: onednn_linear(x, w), base)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert w.grad is None


def test_falls_back_to_f_linear_where_onednn_does_not_apply():
    """bf16 weights, CPU autocast and DeepSpeed ZeRO-3 partitions (`ds_id`) take `F.linear` itself:
    the result is bit-identical to it."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 16, generator=g), torch.randn(8, 16, generator=g)
    bf_x, bf_w = x.bfloat16(), w.bfloat16()
    assert not takes_onednn(bf_x, bf_w)
    assert torch.equal(onednn_linear(bf_x, bf_w), F.linear(bf_x, bf_w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not takes_onednn(x, w)
        assert torch.equal(onednn_linear(x, w), F.linear(x, w))
    zero3 = torch.nn.Parameter(w.clone())
    zero3.ds_id = 0
    assert not takes_onednn(x, zero3)
    assert torch.equal(onednn_linear(x, zero3), F.linear(x, zero3))


def test_packed_weight_multiplies_like_the_dense_one():
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    packed = packed_weight(w, 16)
    for rows in (1, 5, 16, 40):  # the packing hint is not a limit
        x = torch.randn(rows, 1, 32, generator=g)
        torch.testing.assert_close(packed_linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


class Custom(torch.nn.Linear):
    """A subclass (an adapter or a quantized layer) keeps its own forward."""


def test_conversion_keeps_parameters_and_skips_subclasses():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Custom(4, 4),
                                torch.nn.Sequential(torch.nn.Linear(4, 2)))
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_onednn_linears(model) == 2
    assert ([type(m).__name__ for m in (model[0], model[1], model[2][0])]
            == ["OneDNNLinear", "Custom", "OneDNNLinear"])
    assert (all(torch.equal(keys[k], v) for k, v in model.state_dict().items())
            and keys.keys() == model.state_dict().keys())
    clone = pickle.loads(pickle.dumps(model))  # Ray and torch.save pickle modules
    assert type(clone[0]) is OneDNNLinear and type(copy.deepcopy(model)[2][0]) is OneDNNLinear
    x = torch.randn(3, 4)
    torch.testing.assert_close(clone(x), model(x))


def test_onednn_and_packing_only_where_they_measured_faster():
    """bench/RESULTS.md (issue 28 item 13): whole training steps read slower through oneDNN on thin layers
    (a side < 256) and on small matmuls, so those keep F.linear; decode packs weights both of whose sides
    are >= 256."""
    w_thin, w_wide = torch.randn(512, 192), torch.randn(1024, 384)  # the tiny / small presets' gate|up
    assert not worth_onednn(torch.randn(4096, 192), w_thin)  # many rows, but a 192-wide layer
    assert not worth_onednn(torch.randn(80, 384), w_wide)  # 80 x 393,216 = 31.5M < 2**25 multiply-adds
    assert worth_onednn(torch.randn(2, 43, 384), w_wide)  # 86 rows: 33.8M
    assert not worth_packing(torch.randn(2048, 192)) and worth_packing(torch.randn(640, 384))
    layer = OneDNNLinear(384, 1024)
    calls = []
    real = cpu_linear._matmul
    cpu_linear._matmul = lambda *a: calls.append(a[0].shape) or real(*a)
    try:
        with torch.no_grad():
            layer(torch.randn(8, 384))
            layer(torch.randn(400, 384))
    finally:
        cpu_linear._matmul = real
    assert calls == [torch.Size([400, 384])]


def test_the_output_head_keeps_f_linear_in_the_forward(tiny_model_dir, monkeypatch):
    """The LM head through oneDNN measured 5-6% slower per training step (small, base at ~180 rows): the
    converted head is marked and its forward is F.linear even where the shape rule would take oneDNN."""
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_SIDE", 0)
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)
    model = load_causal_lm(tiny_model_dir, dtype="fp32", onednn_linear=True)
    assert type(model.lm_head) is OneDNNLinear and model.lm_head.output_head
    assert not any(getattr(m, "output_head", False) for m in model.modules() if m is not model.lm_head)
    assert copy.deepcopy(model).lm_head.output_head  # Ray and torch.save copy the mark
    calls = []
    real = cpu_linear._matmul
    monkeypatch.setattr(cpu_linear, "_matmul", lambda *a: calls.append(a[1].shape) or real(*a))
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert calls and tuple(model.lm_head.weight.shape) not in [tuple(c) for c in calls]


@pytest.fixture
def always_onednn(monkeypatch):
    """Every OneDNNLinear call (the LM head too) and decode matmul through oneDNN (the tiny test models are
    below the rule)."""
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_SIDE", 0)
    monkeypatch.setattr(cpu_linear, "ONEDNN_MIN_MACS", 0)
    monkeypatch.setattr(cpu_linear.OneDNNLinear, "output_head",
                        property(lambda self: False, lambda self, v: None))


def test_loaded_models_train_alike_with_and_without_onednn(tiny_model_dir, tiny_score_model_dir,
                                                           always_onednn):
    """A causal LM and a score model loaded with `onednn_linear` True / False: every linear layer is a
    `OneDNNLinear` / a plain `nn.Linear`; the loss and every parameter's gradient agree to float rounding."""
    ids = torch.randint(3, 200, (3, 17), generator=torch.Generator().manual_seed(4))
    for load, path, read in ((load_causal_lm, tiny_model_dir, lambda out: out.logits),
                             (load_score_model, tiny_score_model_dir, lambda out: out.logits)):
        runs = []
        for onednn in (True, False):
            model = load(path, dtype="fp32", onednn_linear=onednn).train()
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
            assert linears and all((type(m) is OneDNNLinear) == onednn for m in linears)
            loss = read(model(input_ids=ids)).float().square().mean()
            loss.backward()
            runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (loss_a, grads_a), (loss_b, grads_b) = runs
        torch.testing.assert_close(loss_a, loss_b, rtol=1e-5, atol=1e-6)
        for name, grad in grads_a.items():
            torch.testing.assert_close(grad, grads_b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_rollouts_sample_alike_with_and_without_onednn(tiny_model_dir, always_onednn):
    """The rollout engine's fast decode step multiplies by oneDNN-packed weights when the model's linears
    are `OneDNNLinear`, by dense ones otherwise: the same samples, log-probs within 1e-5."""
    tok = load_tokenizer(tiny_model_dir)
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_new_tokens=20, stop_token_ids=[])
    prompts = [[5, 6, 7, 8], list(range(10, 31)), [40, 41]]
    outs = []
    for onednn in (True, False):
        engine = HFRolloutEngine(load_causal_lm(tiny_model_dir, onednn_linear=onednn).eval(), tok,
                                 pad_token_id=tok.pad_token_id)
        outs.append(engine.generate(prompts, params))
        layer = engine._fast.model.model.layers[0]
        assert engine._fast._weights(layer).qkv.packed == onednn
    for ga, gb in zip(*outs, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert a.output_token_ids == b.output_token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_second_order_gradient_raises_instead_of_returning_zeros():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(onednn_linear(x, w).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


def test_nano_and_tiny_presets_compute_as_plain_torch():
    """Below hidden 256 no layer takes oneDNN or a packed weight at any row count (bench/RESULTS.md: the
    default measured no faster there), so the nano and tiny presets compute as --ds.no_onednn_linear."""
    from posttrain.models.tiny import PRESETS

    for name in ("nano", "tiny"):
        p = PRESETS[name]
        kv = p.hidden_size // p.num_attention_heads * p.num_key_value_heads
        h, i = p.hidden_size, p.intermediate_size
        for out_f, in_f in ((h, h), (kv, h), (i, h), (h, i), (2048, h), (h + 2 * kv, h), (2 * i, h)):
            w = torch.empty(out_f, in_f)
            assert not worth_packing(w) and not worth_onednn(torch.empty(8192, in_f), w), (name, out_f, in_f)
    small = PRESETS["small"]
    assert worth_packing(torch.empty(2 * small.intermediate_size, small.hidden_size))
