"""Which roles an RL config has, and whether it runs on Ray: the one rule that the validation,
the start-up notes and the trainer share.

Ray places the roles as soon as one role has more than one rank (`num_nodes × num_gpus_per_node`),
`--vllm.num_engines` asks for rollout engines, or `RAY_ADDRESS` names a cluster to join. Otherwise
the run stays in one process and never imports Ray."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

# `cfg` below is a PPOConfig, typed `Any`: posttrain.config.trainers (and roles, sections) import this module
# through `facts`, so naming PPOConfig or a role class here, even under TYPE_CHECKING, would be an import
# cycle (tests/unit/test_layers.py); a role section is typed by the two fields it is read for.


class RolePlacement(Protocol):
    """A role's section (ActorConfig, CriticConfig, RefConfig, RewardConfig) as its placement reads it."""

    num_nodes: int
    num_gpus_per_node: int


def uses_kl(cfg: Any) -> bool:
    """A KL term (in the reward or as a loss) needs reference log-probs."""
    return cfg.algo.kl.init_coef > 0 or cfg.algo.kl.use_loss


def _same_model(a: str, b: str) -> bool:
    """Two model paths name the same weights: the same local folder, or the same hub id."""
    if os.path.isdir(a) or os.path.isdir(b):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b


def _reference_in_actor(cfg: Any) -> bool:
    ref = cfg.ref.model_name_or_path
    return (cfg.ds.lora.rank > 0 and uses_kl(cfg)
            and (not ref or _same_model(ref, cfg.actor.model_name_or_path or "")))


def role_ranks(role_cfg: RolePlacement) -> int:
    return role_cfg.num_nodes * role_cfg.num_gpus_per_node


@dataclass(frozen=True)
class RunRoles:
    """Which roles an RL run loads and where they run, computed in one place (`run_roles`); the helpers below
    and the trainer read it.

    sections: role name -> its config section, for the roles this run loads: the actor always; the reference
    with a KL term (in the reward or as a loss), unless it is the LoRA actor's base (`reference_in_actor`);
    the critic with GAE; the reward model when rewards come from one (not from --reward.remote_url); the
    teacher with --teacher.model_name_or_path (on-policy distillation).
    reference_in_actor: LoRA actor, KL term, and the reference starts from the actor's weights: the reference
    is the actor's base with the adapter disabled (no second copy, no ref role).
    several_ranks: the first role with more than one rank, as its flags (`--actor.num_nodes 1 x
    --actor.num_gpus_per_node 2`); None: every role has one rank.
    ray_reason: what puts the run on Ray, for messages: `RAY_ADDRESS=...`, `--vllm.num_engines N` or
    `several_ranks`; None: the run stays in one process."""

    sections: dict
    reference_in_actor: bool
    several_ranks: str | None
    ray_reason: str | None

    def has(self, role: str) -> bool:
        return role in self.sections

    @property
    def on_ray(self) -> bool:
        return self.ray_reason is not None

    @property
    def data_parallel(self) -> bool:
        """A trained role (actor or critic) has several ranks, so DeepSpeed ZeRO shards it."""
        return self.on_ray and any(role_ranks(self.sections[r]) > 1 for r in ("actor", "critic")
                                   if r in self.sections)


def run_roles(cfg: Any) -> RunRoles:
    """The `RunRoles` of `cfg` (and of the environment's RAY_ADDRESS)."""
    in_actor = _reference_in_actor(cfg)
    sections = {"actor": cfg.actor}
    if uses_kl(cfg) and not in_actor:
        sections["ref"] = cfg.ref
    if cfg.algo.advantage.estimator == "gae":
        sections["critic"] = cfg.critic
    if not cfg.reward.remote_url and cfg.reward.model_name_or_path:
        sections["reward"] = cfg.reward
    if cfg.teacher.model_name_or_path:
        sections["teacher"] = cfg.teacher
    several = next((f"--{name}.num_nodes {r.num_nodes} x --{name}.num_gpus_per_node {r.num_gpus_per_node}"
                    for name, r in sections.items() if role_ranks(r) > 1), None)
    if os.environ.get("RAY_ADDRESS"):
        reason = f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
    elif (cfg.vllm.num_engines or 0) >= 1:
        reason = f"--vllm.num_engines {cfg.vllm.num_engines}"
    else:
        reason = several
    return RunRoles(sections, in_actor, several, reason)


def critic_path(cfg: Any) -> str:
    """Where the critic's weights start: --critic.model_name_or_path, else the reward model's (a scalar-head
    one: not a process reward model, a causal LM whose tokenizer may differ from the policy's), else the
    actor's."""
    reward = None if getattr(cfg.reward, "prm", False) else cfg.reward.model_name_or_path
    return cfg.critic.model_name_or_path or reward or cfg.actor.model_name_or_path


# The readings of `run_roles` that callers name.
def reference_in_actor(cfg: Any) -> bool:
    return run_roles(cfg).reference_in_actor


def present_roles(cfg: Any) -> dict:
    return run_roles(cfg).sections


def several_ranks(cfg: Any) -> str | None:
    return run_roles(cfg).several_ranks


def ray_reason(cfg: Any) -> str | None:
    return run_roles(cfg).ray_reason


def uses_ray(cfg: Any) -> bool:
    return run_roles(cfg).on_ray


def data_parallel(cfg: Any) -> bool:
    return run_roles(cfg).data_parallel
