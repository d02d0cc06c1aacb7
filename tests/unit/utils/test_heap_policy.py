"""The heap policy of a training process (utils.memory.apply_heap_policy): freed 8 MiB blocks go back to
the OS under it, and stay resident in glibc's heap without it; the user's MALLOC_MMAP_THRESHOLD_ wins."""
import subprocess
import sys
import textwrap

import pytest

from posttrain.utils import memory

# Raise glibc's dynamic threshold (free a 24 MiB mapped block), then allocate 64 x 8 MiB, free every other
# one and report how much of the freed 256 MiB left the resident set.
_PROBE = textwrap.dedent("""
    import sys
    import torch
    from posttrain.utils import memory
    if sys.argv[1] == "policy":
        memory.apply_heap_policy()
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
    big = torch.ones(6 << 20)
    del big
    blocks = [torch.ones(2 << 20) for _ in range(64)]
    before = rss()
    del blocks[::2]
    print((before - rss()) / (256 << 20))
""")


def returned_fraction(mode: str, env=None) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         env=env)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._libc() is None, reason="glibc only")
def test_freed_blocks_leave_the_resident_set_under_the_policy():
    assert returned_fraction("policy") > 0.9
    assert returned_fraction("default") < 0.1  # the control: glibc's default keeps them


def test_the_users_threshold_wins(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "mmap_threshold", calls.append)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    memory.apply_heap_policy()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    memory.apply_heap_policy()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "lots")
    memory.apply_heap_policy()  # not a number: glibc ignored it, and so does the policy (nothing set)
    assert calls == [memory.RUN_MMAP_THRESHOLD, 65536]
