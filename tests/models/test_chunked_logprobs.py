"""forward_logprobs: the log-probs and their gradients in row chunks equal the whole-logits computation
(plain, LoRA, repeated rows as shared prefixes read them), the chunked backward holds less tensor
memory, and a model that transforms its logits after the head keeps the whole-logits path."""
import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from posttrain.algorithms.losses import gathered_logprobs
from posttrain.models import apply_lora, forward_logits, forward_logprobs
from posttrain.models.forward import _chunking_ok
from posttrain.utils.memory import peak_memory

VOCAB = 4096


def llama(seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config).float()


def batch_and_reads(rows=4, length=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on one row
    keep = torch.arange(4, length - 1)
    k = len(keep)
    index = torch.cat([torch.arange(rows * k), torch.tensor([0, 0, k])])  # some rows read twice
    labels = torch.randint(0, VOCAB, (len(index),), generator=g)
    return {"input_ids": ids, "attention_mask": mask}, keep, index, labels


def whole(model, batch, keep, index, labels, temperature):
    logits = forward_logits(model, batch, keep=keep)
    return gathered_logprobs(logits.reshape(-1, logits.shape[-1]), index, labels, temperature)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_whole_values_and_gradients(lora, temperature):
    model = llama()
    if lora:
        model = apply_lora(model, {"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"})
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)  # a non-zero adapter
    batch, keep, index, labels = batch_and_reads()
    want = whole(model, batch, keep, index, labels, temperature)
    (want * torch.linspace(-1, 1, len(want))).sum().backward()
    want_grads = grads(model)
    model.zero_grad(set_to_none=True)
    one_chunk_rows = 5 * VOCAB * 4  # 5 rows per chunk: 32 rows -> 7 chunks, the last one partial
    got = forward_logprobs(model, batch, keep, index, labels, temperature, chunk_bytes=one_chunk_rows)
    (got * torch.linspace(-1, 1, len(got))).sum().backward()
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    got_grads = grads(model)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    for name, g in want_grads.items():
        assert torch.allclose(got_grads[name], g, atol=1e-6, rtol=1e-5), name


def test_small_logits_take_the_whole_path_unchanged():
    model = llama()
    batch, keep, index, labels = batch_and_reads()
    got = forward_logprobs(model, batch, keep, index, labels)  # 32 x 4096 x 4 B < the default budget
    assert torch.equal(got, whole(model, batch, keep, index, labels, 1.0))


def test_chunked_backward_holds_less_tensor_memory():
    model = llama()
    batch, keep, index, labels = batch_and_reads(rows=16, length=40)
    rows = 16 * len(keep)

    def step(chunk_bytes):
        def run():
            out = forward_logprobs(model, batch, keep, index, labels, chunk_bytes=chunk_bytes)
            out.sum().backward()
        model.zero_grad(set_to_none=True)
        return peak_memory(run)[1].peak_bytes

    whole_peak, chunked_peak = step(rows * VOCAB * 4), step(16 * VOCAB * 4)  # 1 chunk vs 16-row chunks
    logits_bytes = rows * VOCAB * 4
    assert whole_peak - chunked_peak > 3 * logits_bytes, (whole_peak, chunked_peak, logits_bytes)


def test_logits_transformed_after_the_head_keep_the_whole_path():
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          final_logit_softcapping=0.5, attn_implementation="eager")
    model = Gemma2ForCausalLM(config).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # logits far beyond the soft cap, so capping changes them
    batch, keep, index, labels = batch_and_reads()
    got = forward_logprobs(model, batch, keep, index, labels, chunk_bytes=5 * VOCAB * 4)
    assert _chunking_ok[model] is False
    assert torch.allclose(got, whole(model, batch, keep, index, labels, 1.0), atol=1e-6, rtol=0)


def test_a_forward_set_on_the_head_instance_comes_back():
    model = llama()
    own = model.lm_head.forward  # a bound method stored on the instance, as wrappers (accelerate's hooks) do
    model.lm_head.forward = own
    batch, keep, index, labels = batch_and_reads()
    got = forward_logprobs(model, batch, keep, index, labels, chunk_bytes=5 * VOCAB * 4)
    assert model.lm_head.__dict__["forward"] is own
    assert torch.allclose(got, whole(model, batch, keep, index, labels, 1.0), atol=1e-6, rtol=0)
