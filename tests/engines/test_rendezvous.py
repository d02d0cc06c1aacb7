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


@pytest.mark.e2e
def test_a_one_process_deepspeed_group_picks_no_port():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
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


@pytest.mark.e2e
def test_two_ranks_form_a_group_through_rank_0s_served_store():
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in procs) == [(0, 3.0, 2), (1, 3.0, 2)]


@pytest.fixture
def worker_module(monkeypatch):
    """`placement.workers` with a role worker's process-wide effects kept out of this test process."""
    import torch
    import torch.distributed as dist

    from posttrain.trainers.rl.placement import workers

    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(workers, "apply_heap_policy", lambda: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr("ray.util.get_node_ip_address", lambda: "127.0.0.1")
    threads = torch.get_num_threads()
    yield workers
    torch.set_num_threads(threads)


def test_a_ray_roles_rank_0_forms_its_group_over_the_store_it_served(worker_module, monkeypatch):
    formed = {}
    monkeypatch.setattr(pdist, "init_process_group_from_store",
                        lambda store, rank, world: formed.update(store=store, rank=rank, world=world))
    rank0 = worker_module.RoleWorker("actor", 0, 2, None, 1, {})
    host, port = rank0.listen_as_master()
    served = rank0._listening[port]
    assert (host, port) == ("127.0.0.1", served.port) and os.environ["MASTER_PORT"] == str(port)
    rank0._join_role_group()
    assert formed == {"store": served, "rank": 0, "world": 2} and not rank0._listening


def test_actor_rank_0_sends_weights_over_the_store_it_served(worker_module, monkeypatch):
    groups = []
    monkeypatch.setattr(worker_module, "SyncGroup", lambda *args, store=None: groups.append((args, store)))
    rank0 = worker_module.RoleWorker("actor", 0, 1, None, 1, {})
    host, port = rank0.listen(3)
    served = rank0._listening[port]
    rank0.sync_join(host, port, 3, "gloo")
    assert groups == [((host, port, 0, 3, "gloo"), served)]
