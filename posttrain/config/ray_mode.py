"""Which roles an RL config has, and whether it runs on Ray: the one rule that the validation,
the start-up notes and the trainer share.

Ray places the roles as soon as one role has more than one rank (`num_nodes × num_gpus_per_node`),
`--vllm.num_engines` asks for rollout engines, or `RAY_ADDRESS` names a cluster to join. Otherwise
the run stays in one process and never imports Ray."""
from __future__ import annotations

import os
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


def reference_in_actor(cfg: Any) -> bool:
    """LoRA actor, KL term, and the reference starts from the actor's weights: the reference is the
    actor's base with the adapter disabled (no second copy, no ref role)."""
    ref = cfg.ref.model_name_or_path
    return (cfg.ds.lora.rank > 0 and uses_kl(cfg)
            and (not ref or _same_model(ref, cfg.actor.model_name_or_path or "")))


def present_roles(cfg: Any) -> dict:
    """role name -> its config section, for the roles this run loads: the actor always; the
    reference with a KL term (in the reward or as a loss), unless it is the LoRA actor's base
    (`reference_in_actor`); the critic with GAE; the reward model when rewards come from one (not
    from --reward.remote_url)."""
    roles = {"actor": cfg.actor}
    if uses_kl(cfg) and not reference_in_actor(cfg):
        roles["ref"] = cfg.ref
    if cfg.algo.advantage.estimator == "gae":
        roles["critic"] = cfg.critic
    if not cfg.reward.remote_url and cfg.reward.model_name_or_path:
        roles["reward"] = cfg.reward
    return roles


def role_ranks(role_cfg: RolePlacement) -> int:
    return role_cfg.num_nodes * role_cfg.num_gpus_per_node


def several_ranks(cfg: Any) -> str | None:
    """The first present role with more than one rank, as its flags (`--actor.num_nodes 1 x
    --actor.num_gpus_per_node 2`); None: every role has one rank."""
    for name, r in present_roles(cfg).items():
        if role_ranks(r) > 1:
            return f"--{name}.num_nodes {r.num_nodes} x --{name}.num_gpus_per_node {r.num_gpus_per_node}"
    return None


def ray_reason(cfg: Any) -> str | None:
    """What puts the run on Ray, for messages: `RAY_ADDRESS=...`, `--vllm.num_engines N` or a role's ranks
    (`several_ranks`); None: the run stays in one process."""
    if os.environ.get("RAY_ADDRESS"):
        return f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}"
    if (cfg.vllm.num_engines or 0) >= 1:
        return f"--vllm.num_engines {cfg.vllm.num_engines}"
    return several_ranks(cfg)


def uses_ray(cfg: Any) -> bool:
    return ray_reason(cfg) is not None


def data_parallel(cfg: Any) -> bool:
    """A trained role (actor or critic) has several ranks, so DeepSpeed ZeRO shards it."""
    roles = present_roles(cfg)
    return uses_ray(cfg) and any(role_ranks(roles[r]) > 1 for r in ("actor", "critic") if r in roles)
