"""The fused kernel's query runs (`models.context_parallel_kernels`): on CPU, runs attended with bottom-right
causal masks (the varlen kernel's contract) equal the masked attention of the context-parallel module; on a
CUDA GPU, torch's varlen flash kernel equals the masked sdpa forward and backward."""
import pytest
import torch
import torch.nn.functional as F

from posttrain.models.context_parallel_kernels import fused_available, query_runs, varlen_attention


def split_row(lengths: list[int], size: int, rank: int):
    """A packed row of samples `lengths` padded to a multiple of `size`: this rank's (q_sample, q_index),
    the row's sample ids (-1 on padding) and the mask "same sample, key at or before the query; padding
    attends itself" [T_local, T]."""
    total = -(-sum(lengths) // size) * size
    sample = torch.full((total,), -1)
    sample[:sum(lengths)] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(total)
    part = total // size
    q_index, q_sample = index[rank * part:(rank + 1) * part], sample[rank * part:(rank + 1) * part]
    allowed = ((q_sample[:, None] == sample[None, :]) & (index[None, :] <= q_index[:, None])
               & (sample[None, :] >= 0)) | (index[None, :] == q_index[:, None])
    return q_sample, q_index, sample, allowed


def runs_attention(q, k, v, runs, scale=None):
    """What the varlen kernel computes, in sdpa: each run's queries against its keys, causal aligned at the
    bottom right."""
    outs = []
    for r in range(len(runs.cu_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (runs.cu_q[r], runs.cu_q[r + 1], runs.cu_k[r], runs.cu_k[r + 1]))
        keys = runs.key_index[ks:ke]
        lq, lk = qe - qs, ke - ks
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        outs.append(F.scaled_dot_product_attention(q[:, :, qs:qe], k[:, :, keys], v[:, :, keys],
                                                   attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2)


CASES = [([5, 7, 6], 2), ([5, 7, 5], 2), ([9, 9], 2), ([1, 16], 2), ([4, 3, 8, 2], 3), ([3], 4)]


@pytest.mark.parametrize("lengths,size", CASES)
def test_query_runs_read_exactly_the_masked_keys(lengths, size):
    g = torch.Generator().manual_seed(0)
    for rank in range(size):
        q_sample, q_index, sample, allowed = split_row(lengths, size, rank)
        runs = query_runs(q_sample, q_index, sample)
        assert int(runs.cu_q[-1]) == len(q_index) and int(runs.cu_k[-1]) == len(runs.key_index)
        q = torch.randn(1, 4, len(q_index), 8, generator=g)
        k, v = torch.randn(2, 1, 4, len(sample), 8, generator=g)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        torch.testing.assert_close(runs_attention(q, k, v, runs), want, rtol=1e-5, atol=1e-6)


def test_the_fused_kernel_is_off_on_cpu_and_in_fp32():
    assert not fused_available(torch.zeros(1, 2, 3, 4))
    assert not fused_available(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lengths,size", CASES)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_kernel_equals_masked_sdpa_forward_and_backward(lengths, size, kv_heads):
    """bf16 on the GPU against the fp32 masked computation: outputs and the gradients of q, k and v."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for rank in range(size):
        q_sample, q_index, sample, allowed = (t.cuda() for t in split_row(lengths, size, rank))
        assert fused_available(torch.zeros(1, 4, 8, 64, device="cuda", dtype=torch.bfloat16))
        runs = query_runs(q_sample, q_index, sample)
        q = torch.randn(1, 4, len(q_index), 64, device="cuda", generator=g)
        k, v = torch.randn(2, 1, kv_heads, len(sample), 64, device="cuda", generator=g)
        grad = torch.randn(1, 4, len(q_index), 64, device="cuda", generator=g)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        per = 4 // kv_heads
        want = F.scaled_dot_product_attention(leaves[0], leaves[1].repeat_interleave(per, 1),
                                              leaves[2].repeat_interleave(per, 1), attn_mask=allowed)
        want.backward(grad)
        half = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        got = varlen_attention(*half, runs, None)
        got.backward(grad.to(torch.bfloat16))
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
        for a, b in zip(half, leaves):
            torch.testing.assert_close(a.grad.float(), b.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_bf16_model_on_the_gpu_runs_context_parallel_attention_in_the_fused_kernel(tmp_path, monkeypatch):
    """A tiny llama in bf16 over a one-rank NCCL group: the packed row's loss and gradients with the
    context-parallel attention (fused kernel) equal the packed forward's (block-causal sdpa), and the kernel
    ran."""
    import socket

    import torch.distributed as dist

    from posttrain.models import build_tiny, forward_logits, load_causal_lm
    from posttrain.models import context_parallel as cp
    from posttrain.models import context_parallel_kernels as kernels

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        build_tiny(tmp_path / "m", arch="llama", size="nano", seed=0, verbose=False)
        model = load_causal_lm(tmp_path / "m", "bf16").cuda()
        lengths = [5, 7, 6]
        ids = torch.randint(3, model.config.vocab_size, (1, sum(lengths)), device="cuda")
        pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()

        def loss_and_grads(logits):
            loss = logits.float().logsumexp(-1).sum()
            loss.backward()
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
            model.zero_grad()
            return float(loss.detach()), grads

        want, want_grads = loss_and_grads(forward_logits(model, {"input_ids": ids, "position_ids": pos}))
        calls = []
        monkeypatch.setattr(cp, "varlen_attention", lambda *a: calls.append(1)
                            or kernels.varlen_attention(*a))
        model.set_attn_implementation(cp.register())
        with cp.context_parallel(dist.group.WORLD, pos, torch.ones_like(ids, dtype=torch.bool)):
            got, got_grads = loss_and_grads(model(input_ids=ids, position_ids=pos, use_cache=False).logits)
        assert calls, "the fused kernel did not run"
        assert got == pytest.approx(want, rel=1e-2)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=5e-2, atol=5e-2 * float(g.abs().max()) + 1e-3)
    finally:
        dist.destroy_process_group()
