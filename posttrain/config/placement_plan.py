"""Where each role of a distributed RL run goes: OpenRLHF 0.10.2's rules (cli/train_ppo_ray.py,
trainer/ray/launcher.py `RayActorGroup`, trainer/ray/vllm_engine.py `create_vllm_engines`), as pure
Python: no ray, no torch. A function of the flags alone, so start-up checks it (`validate`) before anything
loads, and the Ray placement (`trainers/rl/placement/ray_placement.py`) places what it returns: placement
groups of PACK bundles, one per rank."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from posttrain.config.ray_mode import run_roles
from posttrain.config.sections import VLLM_RANKS
from posttrain.utils.errors import UserError

SHARED = 0.2  # OpenRLHF's num_gpus_per_actor (and engine num_gpus) when models share a bundle


class PlacementError(UserError, ValueError):
    """Colocation flags whose role sizes do not fit together (OpenRLHF asserts the same)."""


@dataclass(frozen=True)
class RoleSpec:
    """A role's `num_ranks` ranks: rank r sits at `bundles[r]` of placement group `group` and asks `share`
    of it. `group` "" means no placement group (plain 1-GPU Ray actors, `bundles` empty). An engine of
    tensor-parallel size tp spans `span` = tp bundles from `bundles[r]`, its workers asking `share` each."""

    name: str
    num_ranks: int
    group: str
    bundles: tuple[int, ...]
    share: float
    span: int = 1


@dataclass(frozen=True)
class Placement:
    """The roles that exist and the placement groups (name -> number of bundles) they need."""

    roles: dict[str, RoleSpec]
    groups: dict[str, int]

    def table(self) -> list[tuple[str, str]]:
        """(role, where) rows for a printed summary."""
        rows = []
        for s in self.roles.values():
            if not s.group:
                where = f"no placement group, {s.num_ranks} x 1 GPU"
            else:
                hi = s.bundles[-1] + s.span - 1
                span = f"bundle {hi}" if hi == s.bundles[0] else f"bundles {s.bundles[0]}-{hi}"
                where = f"group {s.group} {span}, {s.share:g} of each"
                if s.span > 1:
                    where += f" ({s.span} per {s.name})"
            rows.append((s.name, where))
        return rows

    @property
    def world(self) -> int:
        """Distinct bundles (= GPUs) the run needs: every group's bundles plus the group-less ranks."""
        loose = sum(s.num_ranks * s.span for s in self.roles.values() if not s.group)
        return sum(self.groups.values()) + loose


def engine_count(cfg: Any) -> int:
    """Rollout engines of a PPOConfig: --vllm.num_engines; unset, one per `engine_ranks` actor bundles with
    --train.colocate_all (each actor GPU also generates, as OpenRLHF's actors do without vLLM), else one."""
    if cfg.vllm.num_engines:
        return cfg.vllm.num_engines
    if cfg.train.colocate_all:
        return max(1, cfg.actor.num_nodes * cfg.actor.num_gpus_per_node // cfg.vllm.engine_ranks)
    return 1


def plan_of(cfg: Any) -> Placement:
    """The placement of a PPOConfig's roles (`ray_mode.run_roles`) and engines; raises PlacementError."""
    roles = run_roles(cfg).sections

    def shape(name: str) -> tuple[int, int] | None:
        return (roles[name].num_nodes, roles[name].num_gpus_per_node) if name in roles else None
    return plan_placement(
        actor=shape("actor"), ref=shape("ref"), critic=shape("critic"), reward=shape("reward"),
        num_engines=engine_count(cfg), engine_tp=cfg.vllm.engine_ranks,
        colocate_actor_ref=cfg.train.colocate_actor_ref,
        colocate_critic_reward=cfg.train.colocate_critic_reward, colocate_all=cfg.train.colocate_all,
        async_enable=cfg.train.async_enable, teacher=shape("teacher"))


def _ranks(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1]  # (num_nodes, num_gpus_per_node)


def plan_placement(
    *,
    actor: tuple[int, int],
    ref: tuple[int, int] | None,
    critic: tuple[int, int] | None,
    reward: tuple[int, int] | None,
    num_engines: int,
    engine_tp: int = 1,
    colocate_actor_ref: bool = False,
    colocate_critic_reward: bool = False,
    colocate_all: bool = False,
    async_enable: bool = False,
    teacher: tuple[int, int] | None = None,
) -> Placement:
    """Place each role given as (num_nodes, num_gpus_per_node), None: absent. `num_engines` 0: the actor
    ranks generate. Follows `train()` of train_ppo_ray.py step by step; raises PlacementError. The teacher
    (on-policy distillation, not in OpenRLHF) is placed as the reference is: with it in the actor's group
    under --train.colocate_actor_ref / colocate_all, else in a group of its own."""
    roles: dict[str, RoleSpec] = {}
    groups: dict[str, int] = {}

    def place(name: str, shape: tuple[int, int], pg: str | None) -> None:
        """In a shared group `pg`: rank r at bundle r, 0.2 each. Else `RayActorGroup._initiate_actors`:
        its own PACK group when num_gpus_per_node > 1, otherwise plain 1-GPU actors."""
        n = _ranks(shape)
        if pg and n > groups[pg]:  # OpenRLHF does not check; Ray rejects the bundle index
            raise PlacementError(
                f"--train.colocate_{pg} puts the {name} on the actor's {groups[pg]} bundles: "
                f"--{name}.num_nodes x --{name}.num_gpus_per_node ({shape[0]} x {shape[1]}) must not "
                f"exceed the actor's ({actor[0]} x {actor[1]})"
            )
        if not pg and shape[1] > 1:
            groups[name] = n
        group = pg or (name if shape[1] > 1 else "")
        roles[name] = RoleSpec(name, n, group, tuple(range(n)) if group else (), SHARED if pg else 1.0)

    # colocate_actor_ref / colocate_all: one group of actor-many bundles (asserted only if the ref exists).
    pg = None
    if colocate_actor_ref or colocate_all:
        flag = "colocate_all" if colocate_all else "colocate_actor_ref"
        if ref is not None and tuple(ref) != tuple(actor):
            raise PlacementError(
                f"--train.{flag} needs --ref.num_nodes/--ref.num_gpus_per_node equal to the actor's "
                f"({ref[0]} x {ref[1]} vs {actor[0]} x {actor[1]})"
            )
        pg = "all" if colocate_all else "actor_ref"
        groups[pg] = _ranks(actor)
    place("actor", actor, pg)
    if ref is not None:
        place("ref", ref, pg)
    if teacher is not None:
        place("teacher", teacher, pg)

    if num_engines > 0:
        hybrid = colocate_all and not async_enable
        roles["engine"] = _place_engines(groups, pg, actor, num_engines, engine_tp, hybrid)

    # Critic and reward model keep the shared group only under colocate_all; colocate_critic_reward
    # (with a critic) replaces it by a group of critic-many bundles.
    if not colocate_all:
        pg = None
    if critic is not None and colocate_critic_reward:
        if reward is not None and tuple(reward) != tuple(critic):
            raise PlacementError(
                "--train.colocate_critic_reward needs --reward.num_nodes/--reward.num_gpus_per_node equal "
                f"to the critic's ({reward[0]} x {reward[1]} vs {critic[0]} x {critic[1]})"
            )
        pg = "critic_reward"
        groups[pg] = _ranks(critic)
    if critic is not None:
        place("critic", critic, pg)
    if reward is not None:
        place("reward", reward, pg)
    return Placement(_fit_shares(roles, roles["teacher"].group if teacher is not None else ""), groups)


def _fit_shares(roles: dict[str, RoleSpec], group: str) -> dict[str, RoleSpec]:
    """The roles of shared group `group` (the teacher's; "" none) ask 1/k of a bundle each when k roles at
    SHARED would ask more than one (a teacher colocated with all five of OpenRLHF's roles: 6 x 0.2)."""
    members = [name for name, spec in roles.items() if group and spec.group == group and spec.share == SHARED]
    if len(members) * SHARED <= 1:
        return roles
    return {name: replace(spec, share=1 / len(members)) if name in members else spec
            for name, spec in roles.items()}


def _place_engines(groups: dict[str, int], pg: str | None, actor: tuple[int, int], num_engines: int,
                   engine_tp: int, hybrid: bool) -> RoleSpec:
    """The vLLM engines: hybrid (colocate_all, not async) share the actor's group `pg`, else their own
    PACK group of num_engines * tp bundles (added to `groups`); engine i starts at bundle i * tp
    (get_bundle_indices)."""
    if hybrid and _ranks(actor) != num_engines * engine_tp:
        raise PlacementError(
            "--train.colocate_all needs --actor.num_nodes x --actor.num_gpus_per_node equal to "
            f"{VLLM_RANKS} ({_ranks(actor)} vs {num_engines * engine_tp}); or set --train.async_enable to "
            "give the engines their own GPUs"
        )
    if not hybrid:
        groups["engines"] = num_engines * engine_tp
    bundles = tuple(i * engine_tp for i in range(num_engines))
    return RoleSpec("engine", num_engines, pg if hybrid else "engines", bundles, SHARED if hybrid else 1.0,
                    engine_tp)

