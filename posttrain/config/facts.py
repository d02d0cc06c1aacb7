"""The vocabulary of "has no effect" facts that a flag declares with `opt(..., inert=...)`.

An `Inert(reason, when, trainers)` says: when the flag is set away from its default, in a run of one of
`trainers` (None: every trainer), and `when(value, cfg, device_type)` holds (None: always, i.e. a feature
this version does not have), setting it changes nothing, and start-up says so with `reason` (followed by
`when`'s answer when that is a string: the run-specific why). The conditions below are the ones several
flags share; `posttrain.config.inert` applies the facts."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

from posttrain.config.ray_mode import data_parallel, present_roles, reference_in_actor, uses_ray
from posttrain.utils.extras import installed

Condition = Callable[[Any, Any, str], "bool | str"]
PPO = ("ppo",)
SINGLE_MODEL = ("sft", "rm", "dpo", "kd", "kto", "prm")


class Inert(NamedTuple):
    reason: str
    when: Condition | None = None
    trainers: tuple[str, ...] | None = None


def in_section(test: Callable[[Any, Any, str, str], bool | str], up: int = 0) -> Condition:
    """A condition on the flag's own section: `test(value, section, device_type, prefix)`, where `section`
    is the config object holding the flag (the whole config for a flat flag, `cfg.actor` for
    `--actor.x`) and `prefix` its dotted path with a trailing dot ("" or "actor."); `up=1`: the section
    holding the flag's section (`cfg.actor` for `--actor.muon.lr`). For facts shared by sections that
    several roles inherit (the optimizer fields of `--actor.*` and `--critic.*`)."""
    test.on_section = 1 + up  # dotted parts dropped from the path, read by `inert.InertRule.explain`
    return test


def not_yet(feature: str, trainers: tuple[str, ...] | None = None) -> Inert:
    """A feature this version does not have: the flag never acts."""
    return Inert(NOT_YET + feature, None, trainers)


def needs(flag: str, is_on: Callable[[Any], Any], trainers: tuple[str, ...] | None = None) -> Inert:
    """The flag is read only when `flag` is on (`is_on(cfg)` truthy)."""
    return Inert(f"needs {flag}", lambda v, c, dev: not is_on(c), trainers)


NOT_YET = "not available in this version: "
ONE_PROCESS = ("every role runs in this one process (no role has more than one rank, no --vllm.num_engines, "
               "no RAY_ADDRESS), so there is nothing to place or sync")
PPO_ENGINE = ("DeepSpeed ZeRO shards a role over its ranks: the actor and critic have one rank each here "
              "(--actor/--critic.num_nodes x num_gpus_per_node), so they train with the plain torch engine")
SINGLE_ENGINE = ("one process trains with the plain torch engine, and ZeRO shards the model over ranks: "
                 "launch several ranks with torchrun or deepspeed (a DeepSpeed-only flag such as "
                 "--ds.adam_offload also starts DeepSpeed, on one rank)")
NO_EVAL = "no --eval.dataset"
NO_KL = "(--algo.kl.init_coef 0 and no --algo.kl.use_loss)"


def in_process(v, c, dev: str) -> bool:
    return not uses_ray(c)


def on_cpu(v, c, dev: str) -> bool:
    return dev != "cuda"


def no_eval_dataset(v, c, dev: str) -> bool:
    return not c.eval.dataset


def no_vllm(v, c, dev: str) -> bool | str:
    """The reason the rollout engines cannot run vLLM here (falsy: they can)."""
    if not (c.vllm.num_engines or 0) >= 1:
        return "--vllm.num_engines is unset"
    if c.rollout.engine == "hf":
        return "--rollout.engine hf"
    from posttrain.config.backends import partial_rollout_refusal, vllm_unavailable

    return vllm_unavailable() or partial_rollout_refusal(c) or False


def no_reference(v, c, dev: str) -> bool:
    return c.algo.kl.init_coef == 0 and not c.algo.kl.use_loss


def no_critic(v, c, dev: str) -> bool:
    return c.algo.advantage.estimator != "gae"


def no_reward_model_nor_critic(v, c, dev: str) -> bool:
    return not c.reward.model_name_or_path and c.algo.advantage.estimator != "gae"


def single_rank_roles(v, c, dev: str) -> bool:
    return not data_parallel(c)


def no_saves(v, c, dev: str) -> bool:
    return c.ckpt.save_steps <= 0 or c.ckpt.disable_ds


def wandb_off(v, c, dev: str) -> bool:
    return c.logger.wandb.key is None


def no_reward_model(v, c, dev: str) -> bool:
    return "reward" not in present_roles(c)


def launcher_sets_local_rank(v, c, dev: str) -> bool:
    return str(v) != os.environ.get("LOCAL_RANK", "")


def deepspeed_only_flags(ds: Any) -> list[str]:
    """The `--ds.*` flags set in `ds` that only the DeepSpeed engine implements: with any of them a
    one-process sft / rm / dpo run starts DeepSpeed (on one rank) instead of the plain torch engine."""
    set_ = {"adam_offload": ds.adam_offload, "zpg": ds.zpg != 1, "overlap_comm": ds.overlap_comm,
            "grad_accum_dtype": ds.grad_accum_dtype not in (None, "fp32")}
    return ["--ds." + name for name, on in set_.items() if on]


def one_process_torch_engine(v, c, dev: str) -> bool:
    """sft / rm / dpo in one process (WORLD_SIZE unset or 1) without a DeepSpeed-only flag: the run
    trains with the plain torch engine, which has no ZeRO stage."""
    return int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not deepspeed_only_flags(c.ds)


def flash_unavailable(v, c, dev: str) -> bool:
    return str(v).startswith("flash_attention") and (dev != "cuda" or not installed("flash_attn"))


# facts several sections declare
ON_ONE_RANK = Inert(PPO_ENGINE, single_rank_roles, PPO)
ONE_PROCESS_ENGINE = Inert(SINGLE_ENGINE, one_process_torch_engine, SINGLE_MODEL)
EVAL_OFF = Inert(NO_EVAL, no_eval_dataset)
SAVES_OFF = Inert("no checkpoints are saved (--ckpt.save_steps <= 0 or --ckpt.disable_ds)", no_saves)
WANDB_OFF = Inert("W&B is off (no --logger.wandb.key)", wandb_off)
LORA_OFF = Inert("LoRA is off (--ds.lora.rank 0)", lambda v, c, dev: c.ds.lora.rank <= 0)
ROLE_PLACEMENT = Inert(ONE_PROCESS, in_process, PPO)
REF_IN_ACTOR = Inert("the reference is the LoRA actor's base weights with the adapter disabled (no second "
                     "copy, no reference role)", lambda v, c, dev: reference_in_actor(c), PPO)
