"""The Ray placement of an RL run: the controller (the RL loop, in the driver) plus Ray actor
groups — actor, reference, critic, reward model (`RoleWorker` ranks) and rollout engines
(`EngineWorker`) — placed as `config.placement_plan.plan_of` says (OpenRLHF's colocation rules), which
start-up has checked.

The groups (`placement/role_groups.py`) implement the role interface of the in-process roles
(`trainers/rl/roles.py`: `logprobs`, `values`, `fit`, `save_state` / `load_state`, `export`,
`broadcast_weights`), so the loop is the same code in both placements."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from posttrain.config.placement_plan import plan_of
from posttrain.models.parallel_groups import ParallelLayout
from posttrain.models.setup import ModelSetup
from posttrain.rollout.engine_builder import sleeps
from posttrain.trainers.rl.placement.role_groups import (
    ActorGroup,
    CriticGroup,
    EngineGroup,
    Group,
    ReferenceGroup,
    RewardGroup,
    wait_all,
)
from posttrain.trainers.rl.placement.workers import DRIVER_CWD, EngineWorker, RoleWorker
from posttrain.utils.errors import WorkerFailed
from posttrain.utils.interrupt import handlers_kept
from posttrain.utils.log import info, warn_once

if TYPE_CHECKING:
    from posttrain.config import PPOConfig

PLACE_TIMEOUT_S = float(os.environ.get("POSTTRAIN_RAY_PLACE_TIMEOUT", "120"))
WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "DS_BUILD_OPS": "0"}


def worker_env() -> dict[str, str]:
    """What every worker process applies first, in its constructor (no Ray `runtime_env`: a worker
    started for one goes through Ray's `setup_worker.py`, a second interpreter start, ~0.5 CPU-s a worker,
    and cannot reuse Ray's prestarted workers; nothing the ranks import reads these before the
    constructor runs): posttrain's settings plus the driver's NCCL_* / GLOO_* variables
    (network interface choices and debugging reach the ranks), and the driver's working directory
    (`DRIVER_CWD`: a worker changes to it where that folder exists, so relative paths read as the
    command line meant them also in a cluster joined through RAY_ADDRESS)."""
    env = dict(WORKER_ENV)
    env.update({k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_"))})
    env[DRIVER_CWD] = os.getcwd()
    return env


def worker_threads(ranks: int) -> int:
    """Torch threads per rank: the node's cores shared by the ranks of a role that compute at once."""
    return max(1, min(8, (os.cpu_count() or 1) // max(ranks, 1)))


def bundle_resources(share: float, gpu: bool, cpus_per_bundle: float) -> dict:
    """Ray actor options for one rank: OpenRLHF passes num_cpus = num_gpus = share. On a CPU-only
    machine a "GPU" is a bundle of `cpus_per_bundle` CPUs and a rank asks its share of them."""
    if gpu:
        return {"num_gpus": share, "num_cpus": share}
    return {"num_cpus": share * cpus_per_bundle}


def group_bundles(n: int, gpu: bool, cpus_per_bundle: float) -> list[dict]:
    """The `n` bundles of a placement group (strategy PACK)."""
    return [{"GPU": 1, "CPU": 1} if gpu else {"CPU": cpus_per_bundle} for _ in range(n)]


# Ray starts its workers at niceness 15; the ranks are the run's compute, so a local cluster runs them
# at 0 (at 15 they yield the cores to Ray's own daemons: measured ~10-25% slower steps on 2 cores).
# A cluster started by `ray start` takes the same setting from RAY_worker_niceness=0.
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}


def connect(num_bundles: int) -> str | None:
    """Join the cluster at RAY_ADDRESS ("joined") or start a local one ("local"); None when Ray was already
    initialised by the caller (the run then neither kills its Ray nor disconnects from it). Locally, every
    bundle (a "GPU") gets a logical CPU of its own when the machine has fewer."""
    if ray.is_initialized():
        return None
    address = os.environ.get("RAY_ADDRESS")
    if address:
        info(f"joining the Ray cluster at {address}")
        ray.init(address=address, log_to_driver=True)
        return "joined"
    with daemons_in_own_process_group():
        ray.init(num_cpus=max(os.cpu_count() or 1, num_bundles + 1), include_dashboard=False,
                 log_to_driver=True, _system_config=LOCAL_SYSTEM_CONFIG)
    return "local"


@contextlib.contextmanager
def daemons_in_own_process_group():
    """While a local Ray starts: its daemons (GCS, raylet; the workers and agents the raylet starts follow it)
    each in a process group of its own, so a SIGTERM to the run's process group (`kill -TERM -<pgid>`,
    `timeout`) reaches the controller alone, which ends the run and stops that Ray whole; otherwise the
    raylet can die first and Ray's core worker end the controller with exit status 1 before its last line.
    They keep Ray's fate-sharing (they end with the controller's process: Linux's parent-death signal,
    which Ray sets). Ray has no option for it: its process launcher (`ray._private.services.ConsolePopen`)
    is wrapped for the call. Where Ray has no kernel fate-sharing (macOS) it starts a reaper that kills
    the controller's process group when the controller dies, and so nothing is moved there, nor without
    that launcher."""
    from ray._private import services, utils

    launcher = getattr(services, "ConsolePopen", None)
    fate_shared = getattr(utils, "detect_fate_sharing_support_linux", lambda: False)
    if launcher is None or not sys.platform.startswith("linux") or not fate_shared():
        yield
        return

    class OwnGroup(launcher):
        def __init__(self, *args, preexec_fn=None, **kwargs):
            def start():
                os.setpgid(0, 0)
                if preexec_fn is not None:
                    preexec_fn()
            super().__init__(*args, preexec_fn=start, **kwargs)

    services.ConsolePopen = OwnGroup
    try:
        yield
    finally:
        services.ConsolePopen = launcher


class RayPlacement:
    """Start (or join) Ray, place every role of `cfg`, build each rank's model; `shutdown()` removes
    everything the run started."""

    def __init__(self, cfg: PPOConfig, total_steps: int) -> None:
        self.plan = plan_of(cfg)  # the roles `config.ray_mode.run_roles` gives cfg
        self.groups: list[Group] = []
        self.handles: list = []  # every process created so far, so a failure half-way kills them too
        self.pgs: dict = {}
        self.shards: dict[str, list[tuple[int, int]]] = {}  # `_report_shards`
        self.ray: str | None = None  # `connect`: "local", "joined" or None (the caller's Ray)
        try:
            self.ray = connect(self.plan.world)
            self._place(cfg, total_steps)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, cfg: PPOConfig, total_steps: int) -> None:
        self.gpu = ray.cluster_resources().get("GPU", 0) >= 1
        for role, where in self.plan.table():
            info(f"ray placement: {role}: {where}" + ("" if self.gpu else " (a GPU is one CPU rank here)"))
        for name, n in self.plan.groups.items():
            pg = placement_group(group_bundles(n, self.gpu, 1), strategy="PACK")
            self.pgs[name] = pg
            try:
                ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
            except GetTimeoutError:
                raise WorkerFailed(
                    f"Ray cannot place the {name} group ({n} bundles of {group_bundles(1, self.gpu, 1)[0]}) "
                    f"within {PLACE_TIMEOUT_S:.0f} s; the cluster has {ray.cluster_resources()}: lower the "
                    "--*.num_nodes / --*.num_gpus_per_node / --vllm.num_engines counts, colocate roles, or "
                    "add nodes") from None
        roles = self.plan.roles
        setup = ModelSetup.of(cfg)

        def layout(role: str, trained: bool) -> ParallelLayout | None:  # trained roles: split by TP too
            n = self.plan.roles[role].num_ranks
            return setup.layout(n, trained) if n > 1 else None

        self.actor = ActorGroup("actor", self._ranks("actor"), keeps_ema=bool(cfg.train.enable_ema),
                                lora=cfg.ds.lora.rank > 0, layout=layout("actor", True))
        self.ref = ReferenceGroup("ref", self._ranks("ref"), layout("ref", False)) if "ref" in roles else None
        self.teacher = (ReferenceGroup("teacher", self._ranks("teacher"), layout("teacher", False))
                        if "teacher" in roles else None)
        self.critic = (CriticGroup("critic", self._ranks("critic"), layout("critic", True))
                       if "critic" in roles else None)
        self.reward = (RewardGroup("reward", self._ranks("reward"), sharded=cfg.ds.zero_stage == 3,
                                   layout=layout("reward", False)) if "reward" in roles else None)
        backend = cfg.vllm.sync_backend if self.gpu else "gloo"
        if cfg.vllm.sync_backend != "gloo" and not self.gpu:
            warn_once(f"--vllm.sync_backend {cfg.vllm.sync_backend}: no GPU in the cluster, weights sync "
                      "over gloo")
        with_ray = cfg.vllm.sync_with_ray
        hybrid = self.plan.roles["engine"].group == self.plan.roles["actor"].group != ""
        if hybrid and backend == "nccl" and not with_ray:
            # NCCL refuses two ranks on one GPU, and engine 0 shares actor rank 0's (OpenRLHF uses CUDA IPC
            # there)
            info("--train.colocate_all: engine 0 shares actor rank 0's GPU, which NCCL cannot pair; weights "
                 "sync through Ray's object store")
            with_ray = True
        self.engines = EngineGroup("rollout engine", self._engines(cfg.train.partial_rollout_enable),
                                   with_ray=with_ray, backend=backend)
        self.groups = [g for g in (self.actor, self.ref, self.teacher, self.critic, self.reward, self.engines)
                       if g is not None]
        for group in self.groups[:-1]:
            if group.same_rows > 1:  # each rank's coordinates: a data-parallel index's ranks share rows
                info(f"ray placement: {group.name} ranks: {group.layout.describe()}")
        wait_all([(h.pid.remote(), g.label(i)) for g in self.groups for i, h in enumerate(g.handles)],
                 timeout=PLACE_TIMEOUT_S)
        t0 = time.perf_counter()
        calls = [(h.setup.remote(cfg, total_steps), g.label(i)) for g in self.groups if g is not self.engines
                 for i, h in enumerate(g.handles)]
        calls += [(h.setup.remote(cfg), self.engines.label(i)) for i, h in enumerate(self.engines.handles)]
        wait_all(calls)
        described = self.engines.describe()
        info(f"ray placement: {sum(len(g.handles) for g in self.groups)} processes ready in "
             f"{time.perf_counter() - t0:.1f} s; {described}")
        self._report_shards()
        if sleeps(cfg) and self.engines.kinds == ["vllm"]:
            self._sleep_engines(cfg.vllm.sleep_level)

    def _sleep_engines(self, level: int) -> None:
        """--vllm.enable_sleep: the engines sleep from now on between rollouts (OpenRLHF puts them to sleep
        once built); start-up says what that frees here."""
        self.engines.sleep_level = level
        freed = self.engines.sleep()
        rss = freed[0]["rss_bytes"] / 2**20 if freed else 0.0
        if self.gpu:
            info(f"--vllm.enable_sleep: the rollout engines sleep between rollouts (vLLM's sleep mode, level "
                 f"{level}); engine 0's process RSS fell by {rss:.0f} MiB")
        else:
            kv = freed[0]["kv_cache_bytes"] / 2**20 if freed else 0.0
            info(f"--vllm.enable_sleep: vLLM's CPU build has no sleep mode, so posttrain frees each rollout "
                 f"engine's KV cache between rollouts ({kv:.0f} MiB; engine 0's RSS fell by {rss:.0f} MiB); "
                 "the weights stay"
                 + (" in memory, and each sync sends all of them (level 2)" if level == 2 else ""))

    def _report_shards(self) -> None:
        """One line per role of several ranks: the parameters each rank held once its model was loaded
        (its ZeRO-3 shard, or a whole copy); kept in `shards` (role -> [(own, full) per rank])."""
        for group in (self.actor, self.ref, self.teacher, self.critic, self.reward):
            if group is None or len(group.handles) < 2:
                continue
            sizes = group.call("shard_numel")
            if any(size is None for size in sizes):
                continue
            self.shards[group.name] = [tuple(size) for size in sizes]
            full = sizes[0][1]
            sharded = any(own < whole for own, whole in sizes)
            kind = "ZeRO-3 shards" if sharded else "a whole copy on each rank"
            held = ", ".join(f"rank {i} {own} ({own / max(full, 1):.0%})" for i, (own, _) in enumerate(sizes))
            info(f"ray placement: {group.name} loaded as {kind} of {full} parameters: {held}")

    def _options(self, role: str, rank: int) -> dict:
        spec = self.plan.roles[role]
        opts = bundle_resources(spec.share if spec.group else 1.0, self.gpu, 1)
        if spec.group:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self.pgs[spec.group], placement_group_bundle_index=spec.bundles[rank])
        return opts

    def _ranks(self, role: str) -> list:
        n = self.plan.roles[role].num_ranks
        env = worker_env()
        cls = ray.remote(RoleWorker)
        first = cls.options(**self._options(role, 0)).remote(role, 0, n, None, worker_threads(n), env)
        self.handles.append(first)
        # rank 0 serves the group's rendezvous store on a port it binds at once, before the others start
        master = (wait_all([(first.listen_as_master.remote(), f"{role} rank 0")], PLACE_TIMEOUT_S)[0]
                  if n > 1 else None)
        rest = [cls.options(**self._options(role, r)).remote(role, r, n, master, worker_threads(n), env)
                for r in range(1, n)]
        self.handles += rest
        return [first] + rest

    def _engines(self, partial_rollout: bool) -> list:
        n = self.plan.roles["engine"].num_ranks
        cls = ray.remote(EngineWorker)
        # partial rollout: a weight sync arrives while generate runs (a second thread of the actor)
        concurrency = {"max_concurrency": 2} if partial_rollout else {}
        engines = [cls.options(**self._options("engine", i), **concurrency).remote(worker_threads(n),
                                                                                  worker_env())
                   for i in range(n)]
        self.handles += engines
        return engines

    def shutdown(self) -> None:
        """Remove what the run started. A local Ray the run started is stopped as a whole (its processes,
        and with them every worker) without calls to its GCS: a SIGTERM to every process of the job (Slurm)
        ends that GCS too, and a call to it would wait 60 s and exit 1. In a joined cluster,
        the run's actors are killed and its placement groups removed (also in a Ray the caller started),
        then the run disconnects from a cluster it joined."""
        if self.ray == "local":
            self.handles, self.pgs = [], {}
        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception:  # already gone
                pass
        self.handles = []
        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        self.groups, self.pgs = [], {}
        if self.ray and ray.is_initialized():
            with handlers_kept():  # a stopping run keeps ignoring a second Ctrl-C / SIGTERM
                ray.shutdown()
            self.ray = None
