"""Process-group rendezvous without a port race (`engines.dist`): a one-process group binds no port, and a Ray
role's rank 0 serves its group's store on a port it binds at once, so no other process can take it between
"found free" and "bound" (this ended a 2-rank Ray run at start-up with EADDRINUSE)."""
import errno
import multiprocessing as mp
import os
import socket
import subprocess
import sys

import pytest

from posttrain.engines import dist as pdist

pytestmark = pytest.mark.e2e

ONE_PROCESS = """
import os, socket
taken = socket.socket()
taken.bind(("127.0.0.1", 0))
taken.listen()
os.environ["MASTER_PORT"] = str(taken.getsockname()[1])  # a leftover MASTER_PORT another process holds
from posttrain.engines.deepspeed_engine import start_process_group
import torch, torch.distributed as dist
start_process_group()
t = torch.ones(2)
dist.all_reduce(t)
print("world", dist.get_world_size(), "sum", float(t.sum()))
dist.destroy_process_group()
"""


def test_a_one_process_deepspeed_group_binds_no_port():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "-c", ONE_PROCESS], capture_output=True, text=True, timeout=120,
                          check=False, env={**env, "DS_BUILD_OPS": "0", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world 1 sum 2.0" in proc.stdout


def test_a_served_store_holds_its_port_from_the_start():
    store = pdist.serve_store("127.0.0.1", 2)
    with socket.socket() as s, pytest.raises(OSError) as e:
        s.bind(("", store.port))
    assert e.value.errno == errno.EADDRINUSE


def _rank(rank: int, ports, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if rank == 0:
        store = pdist.serve_store("127.0.0.1", 2)
        ports.put(store.port)
    else:
        store = pdist.connect_store("127.0.0.1", ports.get(timeout=60), 2)
    pdist.init_process_group_from_store(store, rank, 2, backend="gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    results.put((rank, float(t), dist.get_world_size()))
    pdist.shutdown()


def test_two_ranks_form_a_group_through_rank_0s_served_store():
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in procs) == [(0, 3.0, 2), (1, 3.0, 2)]
