"""forward_logits / forward_values: packed and padded batches give the log-probs of each sample
run alone; the negative controls show the test would catch a leaking mask."""
import pytest
import torch

from posttrain.models import (
    block_causal_mask,
    build_tiny,
    forward_logits,
    forward_values,
    load_causal_lm,
    load_score_model,
)

LENGTHS = (5, 9, 3)


def token_logprobs(logits, ids):
    """log p(ids[t] | ids[<t]) for t >= 1: [.., T-1]."""
    return torch.log_softmax(logits[..., :-1, :], -1).gather(-1, ids[..., 1:, None]).squeeze(-1)


def samples(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]


def alone(model, seqs):
    return [token_logprobs(forward_logits(model, {"input_ids": s[None]}), s[None])[0] for s in seqs]


def packed_batch(seqs):
    return {"input_ids": torch.cat(seqs)[None],
            "position_ids": torch.cat([torch.arange(len(s)) for s in seqs])[None]}


def split_packed(logprobs_row, seqs):
    """Per-sample log-probs from a packed row, dropping the cross-boundary predictions."""
    out, start = [], 0
    for s in seqs:
        out.append(logprobs_row[start:start + len(s) - 1])
        start += len(s)
    return out


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2") / "nano"
    build_tiny(path, arch="qwen2", size="nano", seed=1, verbose=False)
    return str(path)


@pytest.fixture(scope="module", params=["llama-sdpa", "llama-eager", "qwen2-sdpa"])
def model(request, tiny_model_dir, qwen2_dir):
    arch, attn = request.param.split("-")
    m = load_causal_lm(tiny_model_dir if arch == "llama" else qwen2_dir, "fp32", attn_implementation=attn)
    with torch.no_grad():  # sharpen the random init so attention is far from uniform
        for name, p in m.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return m


def test_block_causal_mask_by_hand():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(block_causal_mask(pos)[0, 0], expected)
    padded = block_causal_mask(pos, attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]))[0, 0]
    assert torch.equal(padded,
                       expected & torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool)
                       | torch.eye(6, dtype=torch.bool))


@torch.no_grad()
def test_packed_equals_alone(model):
    seqs = samples(model.config.vocab_size)
    ref = alone(model, seqs)
    batch = packed_batch(seqs)
    logits = forward_logits(model, batch)
    assert logits.dtype == torch.float32 and logits.shape == (1, sum(LENGTHS), model.config.vocab_size)
    got = split_packed(token_logprobs(logits, batch["input_ids"])[0], seqs)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)


@torch.no_grad()
def test_packed_without_restarts_or_block_mask_differs(model):
    """Negative controls: (a) one causal sequence over the concatenation (no position restarts,
    no block mask); (b) restarted positions but a plain causal mask. Both leak earlier samples
    into later ones, so samples 2 and 3 differ from their solo log-probs; sample 1 does not."""
    seqs = samples(model.config.vocab_size)
    ref = alone(model, seqs)
    batch = packed_batch(seqs)
    plain = forward_logits(model, {"input_ids": batch["input_ids"]})
    leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                  attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False).logits
    for logits in (plain, leaky):
        got = split_packed(token_logprobs(logits, batch["input_ids"])[0], seqs)
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
        for g, r in zip(got[1:], ref[1:]):
            assert (g - r).abs().max() > 1e-2


@torch.no_grad()
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_equals_alone(model, side):
    seqs = samples(model.config.vocab_size, seed=1)
    ref = alone(model, seqs)
    t = max(LENGTHS)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        span = slice(0, len(s)) if side == "right" else slice(t - len(s), t)
        ids[i, span], mask[i, span] = s, 1
    lp = token_logprobs(forward_logits(model, {"input_ids": ids, "attention_mask": mask}), ids)
    for i, (s, r) in enumerate(zip(seqs, ref)):
        got = lp[i, : len(s) - 1] if side == "right" else lp[i, t - len(s):]
        torch.testing.assert_close(got, r, atol=1e-5, rtol=0)


@torch.no_grad()
def test_packed_with_tail_padding(model):
    seqs = samples(model.config.vocab_size, seed=2)
    ref = alone(model, seqs)
    batch = packed_batch(seqs)
    pad = 4
    batch = {"input_ids": torch.cat([batch["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1),
             "position_ids": torch.cat([batch["position_ids"], torch.arange(pad)[None]], 1),
             "attention_mask": torch.cat([torch.ones(1, sum(LENGTHS), dtype=torch.long),
                                          torch.zeros(1, pad, dtype=torch.long)], 1)}
    logits = forward_logits(model, batch)
    assert torch.isfinite(logits).all()
    got = split_packed(token_logprobs(logits, batch["input_ids"])[0], seqs)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)


@torch.no_grad()
def test_score_model_values_packed_equal_alone(tiny_model_dir):
    torch.manual_seed(0)
    rm = load_score_model(tiny_model_dir, "fp32", new_head_ok=True)
    seqs = samples(rm.config.vocab_size, seed=3)
    ref = [forward_values(rm, {"input_ids": s[None]})[0] for s in seqs]
    values = forward_values(rm, packed_batch(seqs))[0]
    assert values.shape == (sum(LENGTHS),)
    torch.testing.assert_close(torch.cat(ref), values, atol=1e-5, rtol=0)
    # the value at a sample's last token is what HF's sequence-classification pooling returns
    pooled = rm(input_ids=seqs[1][None]).logits[0, 0]
    torch.testing.assert_close(ref[1][-1], pooled, atol=1e-6, rtol=0)


def test_bad_batch_shapes(tiny_model_dir):
    m = load_causal_lm(tiny_model_dir, "fp32")
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="position_ids"):
        forward_logits(m, {"input_ids": ids, "position_ids": torch.arange(3)[None]})
    with pytest.raises(ValueError, match="attention_mask"):
        forward_logits(m, {"input_ids": ids, "attention_mask": torch.ones(1, 5)})
