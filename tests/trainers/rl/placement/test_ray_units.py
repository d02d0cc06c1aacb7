"""Pieces of the Ray placement that need no cluster: metric merging, Ray's resource options, the weights
hash, the transport split, a worker's load error."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from posttrain.config import parse_config

ray_placement = pytest.importorskip("posttrain.trainers.rl.placement.ray_placement")
role_groups = pytest.importorskip("posttrain.trainers.rl.placement.role_groups")


def test_rank_metrics_merge_as_one_process_computes_them():
    per_rank = [{"actor/kl_loss": 1.0, "actor/policy_loss": 0.25, "actor/grad_norm": 2.0,
                 "train/rows_per_step": 3},
                {"actor/kl_loss": 3.0, "actor/policy_loss": 0.5, "actor/grad_norm": 2.0,
                 "train/rows_per_step": 5, "rollout/logprob_abs_gap": 0.1}]
    weights = [{"actor/kl_loss": 10.0, "actor/grad_norm": 2.0}, {"actor/kl_loss": 30.0,
                                                                 "actor/grad_norm": 2.0,
                                                                 "rollout/logprob_abs_gap": 7.0}]
    out = role_groups.merge_metrics(per_rank, weights)
    assert out["actor/kl_loss"] == pytest.approx((1.0 * 10 + 3.0 * 30) / 40)  # token-weighted, not (1+3)/2
    assert out["actor/policy_loss"] == pytest.approx(0.75)  # each rank's share of the step's loss
    assert out["train/rows_per_step"] == 8 and out["actor/grad_norm"] == 2.0
    assert out["rollout/logprob_abs_gap"] == pytest.approx(0.1)  # measured by one rank only


def _cfg(*extra):
    from config_args import BASE  # tests/unit/config

    return parse_config("ppo", BASE["ppo"] + list(extra), check=False)


def test_resources_gpu_and_cpu():
    bundle_resources, group_bundles = ray_placement.bundle_resources, ray_placement.group_bundles
    assert bundle_resources(0.2, True, 4) == {"num_gpus": 0.2, "num_cpus": 0.2}
    assert bundle_resources(1.0, True, 4) == {"num_gpus": 1.0, "num_cpus": 1.0}
    assert bundle_resources(0.2, False, 5) == {"num_cpus": pytest.approx(1.0)}
    assert bundle_resources(1.0, False, 2) == {"num_cpus": 2.0}
    assert group_bundles(2, True, 4) == [{"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}]
    assert group_bundles(3, False, 2) == [{"CPU": 2}] * 3
    assert group_bundles(0, True, 1) == []


def test_weights_hash_covers_every_tensor_kind():
    from posttrain.trainers.rl.placement.weight_sync import sync_layout
    from posttrain.utils.weights_hash import WeightsDigest, weights_hash

    state = {"w": torch.arange(6.0).view(2, 3), "scalar": torch.tensor(1.5),
             "half": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0)}
    h = weights_hash(state)
    assert h == weights_hash({k: v.clone() for k, v in reversed(list(state.items()))})  # order-free
    changed = dict(state, scalar=torch.tensor(1.5000001))
    assert weights_hash(changed) != h
    layout = sync_layout(state, bucket_bytes=16)
    assert [len(b) for b in layout] == [1, 1, 1, 1]  # 24-byte tensor alone, then dtype changes split buckets
    assert [name for b in layout for name, _, _ in b] == list(state)
    # an engine hashing the buckets as they arrive (vLLM keeps no HF-named copy) gets the same hash
    received = WeightsDigest()
    assert received.hexdigest() is None
    for bucket in layout:
        for name, _, _ in bucket:
            received.add(name, state[name].clone())
    assert received.hexdigest() == h


def test_split_by_tokens_balances_and_keeps_order():
    from posttrain.trainers.rl.placement.transport import plan_steps, split_by_tokens

    lengths = [10, 1, 1, 1, 9, 1]
    shares = split_by_tokens(range(6), lengths, 2)
    assert sorted(r for s in shares for r in s) == list(range(6))
    assert [sum(lengths[r] for r in s) for s in shares] == [12, 11] and shares[0] == sorted(shares[0])
    assert split_by_tokens([4], lengths, 3) == [[4], [], []]  # fewer rows than ranks: empty shares
    plan = plan_steps([[0, 1], [4, 5]], lengths, 2)
    assert plan == [[[0], [4]], [[1], [5]]]


def test_a_worker_that_cannot_load_its_state_says_so_in_one_line(tmp_path):
    from posttrain.trainers.rl.placement.workers import RoleWorker
    from posttrain.utils.checkpoint import CheckpointError

    class Saved:
        def load_state(self, directory, *args):
            raise ValueError(f"{directory!r} was saved with world_size=2, this run has world_size=1\ndetails")

    worker = RoleWorker.__new__(RoleWorker)  # not its __init__: that sets this process's RANK / WORLD_SIZE
    worker.role, worker.rank, worker.obj = "actor", 1, Saved()
    with pytest.raises(CheckpointError, match=r"^actor rank 1 cannot load .* world_size=2, this run has "
                                              r"world_size=1$"):
        worker.load_state(str(tmp_path))


def test_least_loaded_dispatch_follows_rows_in_flight():
    from posttrain.trainers.rl.placement.transport import least_loaded

    loads = [0, 0, 0]
    assert least_loaded(loads, [4, 4, 4, 4]) == [0, 1, 2, 0] and loads == [8, 4, 4]
    busy = [10, 0, 3]  # another caller's rows still running on engine 0
    assert least_loaded(busy, [2, 2, 2]) == [1, 1, 2] and busy == [10, 4, 5]


def test_a_dispatch_that_fails_to_start_returns_its_load():
    group = role_groups.EngineGroup("rollout", [object(), object()], with_ray=True, backend="gloo")

    def broken(handle, rows):
        raise RuntimeError("the actor died before the call")

    with pytest.raises(RuntimeError, match="died"):
        group._spread(3, 2, broken)
    assert group.loads == [0, 0]  # the next dispatch is not skewed by rows that never ran


@pytest.mark.parametrize("context,tensor", [(2, 1), (1, 2), (2, 2)])
def test_the_ranks_of_a_ring_or_tensor_parallel_group_train_the_same_shuffled_rows(monkeypatch, context,
                                                                                   tensor):
    """The shuffle stays on with ring attention / tensor parallelism (OpenRLHF turns it off): the controller
    shuffles each step's rows once, with the run's seed and step, and every rank of a ring / TP group gets its
    data-parallel index's share, so the group's ranks train identical rows in identical order."""
    from posttrain.models.parallel_groups import ParallelLayout
    from posttrain.rollout.single_turn import Rollout
    from posttrain.trainers.rl.batch_forward import Batching
    from posttrain.trainers.rl.experience import build_experience
    from posttrain.trainers.rl.updates import UpdateSettings

    rolls = [Rollout([3, 4, 5], [6] * (1 + i % 5), [-1.0] * (1 + i % 5), "length", "", "") for i in range(16)]
    exp = build_experience(rolls, torch.zeros(16), 0)
    settings = UpdateSettings(batch_size=8, batching=Batching(2), max_epochs=2, loss_agg="token_mean",
                              max_len=8, eps_low=0.2, eps_high=0.2, dual_clip=None, policy_loss_type="ppo",
                              entropy_coef=None, kl_use_loss=False, kl_estimator="k1", is_correction=None,
                              is_threshold=(0.5, 5.0), value_clip=None, seed=0)
    got = []
    monkeypatch.setattr(role_groups.ray, "put", lambda x: x)
    monkeypatch.setattr(role_groups._RoleGroup, "call_each",
                        lambda self, method, args: got.append([a[1] for a in args]) or [({}, {})] * len(args))
    layout = ParallelLayout(2 * context * tensor, context=context, tensor=tensor)
    group = role_groups.ActorGroup("actor", [object()] * layout.world, keeps_ema=False, layout=layout)
    group.fit(exp, settings, 0.0, 3)
    group.fit(exp, settings, 0.0, 4)
    for plan in got:
        block = context * tensor
        for dp in range(2):
            assert all(plan[r] == plan[dp * block] for r in range(dp * block, (dp + 1) * block))
        steps = [sorted(a + b) for a, b in zip(plan[0], plan[block])]  # the two data indices' shares per step
        assert len(steps) == 4 and sorted(r for s in steps[:2] for r in s) == list(range(16))  # 2 epochs
        assert steps[0] != list(range(8)) and steps[2] != steps[0]  # shuffled, and again in the second epoch
    assert got[0][0] != got[1][0]  # another step, another shuffle


@pytest.mark.parametrize("address", ["10.0.0.1:6379", None])
def test_a_joined_cluster_gets_the_runs_actors_killed_and_a_local_ray_is_stopped_whole(monkeypatch, address):
    """A run that joined a cluster (RAY_ADDRESS) must remove its actors and placement groups there before it
    disconnects; a local Ray it started is stopped as a whole (no calls to its GCS). Ray is stubbed at its
    API: what is checked is which calls the shutdown makes."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[3] / "unit" / "config"))
    calls, up = [], []
    monkeypatch.setattr(ray_placement.ray, "is_initialized", lambda: bool(up))
    monkeypatch.setattr(ray_placement.ray, "init",
                        lambda **kw: (up.append(1), calls.append(("init", kw.get("address"),
                                                                  kw.get("runtime_env")))))
    monkeypatch.setattr(ray_placement.ray, "shutdown", lambda: (up.clear(), calls.append(("shutdown",))))
    monkeypatch.setattr(ray_placement.ray, "kill", lambda h, no_restart: calls.append(("kill", h)))
    monkeypatch.setattr(ray_placement, "remove_placement_group", lambda pg: calls.append(("remove", pg)))
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def place(self, cfg, total_steps):  # the run placed one actor in one placement group, then failed
        self.handles, self.pgs = ["actor rank 0"], {"actor": "actor bundles"}
        raise RuntimeError("a worker failed to start")

    monkeypatch.setattr(ray_placement.RayPlacement, "_place", place)
    with pytest.raises(RuntimeError, match="a worker failed to start"):
        ray_placement.RayPlacement(_cfg(), 1)
    removed = [("kill", "actor rank 0"), ("remove", "actor bundles")] if address else []
    # no runtime_env (a worker with one starts through a second interpreter): the workers take the
    # driver's environment in their constructors (test_a_worker_takes_the_drivers_environment_first)
    assert calls == [("init", address, None), *removed, ("shutdown",)]


def test_a_worker_takes_the_drivers_environment_first(monkeypatch, tmp_path):
    """What a run's workers need from the driver (posttrain's settings, NCCL_* / GLOO_* variables, the
    working directory) reaches them through their constructor, not a Ray runtime_env."""
    from posttrain.trainers.rl.placement.workers import DRIVER_CWD, _Process

    monkeypatch.delenv(DRIVER_CWD, raising=False)  # restored (unset) after the test, as the others
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    monkeypatch.chdir(tmp_path)
    env = ray_placement.worker_env()
    assert env["TOKENIZERS_PARALLELISM"] == "false" and env["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")  # what the worker's node had
    monkeypatch.chdir(tmp_path.parent)  # a joined cluster's worker starts elsewhere
    threads = torch.get_num_threads()
    try:
        _Process(threads, env)
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["TOKENIZERS_PARALLELISM"] == "false"
        assert os.getcwd() == str(tmp_path)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only (Ray's parent-death signal)")
def test_a_local_rays_daemons_start_in_a_process_group_of_their_own():
    """While `daemons_in_own_process_group` holds, a process Ray's launcher starts leads a process group of
    its own (a TERM to the run's group misses it) and still runs Ray's own start-up (`preexec_fn`); after,
    the launcher is Ray's again."""
    from ray._private import services

    launcher = services.ConsolePopen
    code = ("import os, signal; print(os.getpid() == os.getpgid(0), "
            "signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))")

    def run() -> list[str]:
        block = lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # noqa: E731  (as Ray's)
        proc = services.ConsolePopen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                     preexec_fn=block)
        return proc.communicate(timeout=60)[0].split()

    with ray_placement.daemons_in_own_process_group():
        assert run() == ["True", "True"]
    assert services.ConsolePopen is launcher and run() == ["False", "True"]
