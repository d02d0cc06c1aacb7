"""The peak memory of a call: on CUDA from the caching allocator's statistics; on CPU from the
allocation and free events torch's profiler records (`profile_memory`), replayed in time order. Both
count tensor memory only, relative to what was allocated when the call started, so the weights
(allocated before) are not in it and the activations, gradients and temporaries are. Also the
process's peak resident set size (`getrusage`), which never decreases. And glibc's heap controls:
`release_freed_memory` (hand free heap pages back to the OS) and `mmap_threshold` (blocks at least this
large get their own mapping, returned to the OS when freed), and `apply_heap_policy`, the threshold every
training process runs with.

Why a heap policy: glibc serves blocks below its mmap threshold from the heap, and the threshold rises
(up to 32 MiB) each time a mapped block is freed. A training step allocates and frees many 1-32 MiB
activations in changing orders; freed heap memory stays resident and fragmented, so the resident set
grows well above the live tensors. Blocks from 4 MiB get their own mapping (bench/RESULTS.md, 0.5B LoRA
GRPO step: peak 7.10 GiB with glibc's default, 5.38 with 4 MiB; 1 MiB gave 4.86 but made a 29M-parameter
model's step 1.5x slower, from page faults on every reuse of a mapped block)."""
from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryPeak:
    peak_bytes: int  # most tensor memory held during the call, above what was held when it started
    end_bytes: int  # tensor memory still held when it returned, above the start (e.g. new gradients)
    rss_peak_bytes: int  # the process's peak resident set size so far (all memory, since the process started)


def process_peak_rss() -> int:
    """The process's peak resident set size in bytes (ru_maxrss: kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss() -> int | None:
    """The process's resident set size now, in bytes (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_memory(fn, device: str | torch.device = "cpu"):
    """`(fn(), MemoryPeak)`: the tensor memory `fn` used at its peak on `device` ("cpu" or a CUDA
    device). On CPU the profiler slows the call down; measure memory and time in separate calls."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak, end = (torch.cuda.max_memory_allocated(device) - start,
                     torch.cuda.memory_allocated(device) - start)
        return result, MemoryPeak(peak, end, process_peak_rss())
    if device.type != "cpu":
        raise ValueError(f"peak_memory: device {device} is neither cpu nor cuda")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return result, MemoryPeak(peak, held, process_peak_rss())


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim`; nothing elsewhere): large blocks
    freed in a row (a model's weights, gathered modules) otherwise stay resident."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def mmap_threshold(size: int) -> None:
    """glibc's `M_MMAP_THRESHOLD` (fixed from then on; glibc's default starts at 128 KiB and rises to at most
    32 MiB as mapped blocks are freed); nothing without glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, size)  # M_MMAP_THRESHOLD


RUN_MMAP_THRESHOLD = 4 << 20  # blocks from 4 MiB get their own mapping in a training process
_USER_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"  # glibc's own setting; when set, the user's choice stands


def run_mmap_threshold() -> int | None:
    """The mmap threshold a training process runs with: the user's `MALLOC_MMAP_THRESHOLD_` when set (glibc
    applied it at start-up; None if it is not a number), else `RUN_MMAP_THRESHOLD`."""
    user = os.environ.get(_USER_THRESHOLD)
    if user is not None:
        return int(user) if user.strip().isdigit() else None
    return RUN_MMAP_THRESHOLD


def apply_heap_policy() -> None:
    """Set `run_mmap_threshold()` (module doc); called when a trainer or a Ray role process starts."""
    threshold = run_mmap_threshold()
    if threshold is not None:
        mmap_threshold(threshold)
