"""Top-level configs, one per trainer, each with exactly the sections and defaults of the matching
OpenRLHF 0.10.2 entry point (train_sft / train_rm / train_dpo / train_ppo_ray), plus the posttrain
extensions marked in the section modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.config import facts
from posttrain.config.facts import Inert
from posttrain.config.roles import (
    NO_CRITIC,
    Actor,
    Algo,
    Critic,
    DPOModel,
    DPORef,
    Ref,
    Reward,
    RMModel,
    SFTModel,
)
from posttrain.config.sections import (
    DS,
    PPODS,
    VLLM,
    Adam,
    Agent,
    Ckpt,
    DSHead,
    Eval,
    Logger,
    OptimFields,
    PPOCkpt,
    PPOData,
    PPOEval,
    PPOTrain,
    PreferenceData,
    Rollout,
    SFTData,
    Train,
    Wandb,
)
from posttrain.config.spec import opt, section

TRAINERS = ("sft", "rm", "dpo", "ppo")


def _logger(trainer: str):
    return section(Logger, wandb=Wandb(project=f"posttrain_{trainer}"))


def _ckpt(cls, trainer: str, **kw):
    # --ckpt.path stays unset (-> <--ckpt.output_dir>/checkpoints at start-up), not OpenRLHF's
    # ./ckpt/checkpoints_<trainer>, which every run started from one folder would share
    return section(cls, **kw)


@dataclass
class Launcher:
    """Flags set by launchers."""

    local_rank: int = opt(-1, "local rank (injected by the deepspeed launcher)",
                          inert=Inert("the device comes from the LOCAL_RANK environment variable the launcher sets",
                                      facts.launcher_sets_local_rank))
    use_ms: bool = opt(False, "download models from ModelScope instead of the HF hub",
                       inert=Inert("ModelScope downloads are not supported; pass a local folder or an HF hub id"))


@dataclass
class SFTConfig(OptimFields, Launcher):
    """posttrain sft: supervised fine-tuning."""

    trainer: ClassVar[str] = "sft"
    adam: Adam = section(Adam, lr=5e-6)
    model: SFTModel = section(SFTModel)
    ds: DS = section(DS)
    data: SFTData = section(SFTData, input_template="User: {}\nAssistant: ", max_len=2048)
    train: Train = section(Train, micro_batch_size=8, max_epochs=2)
    eval: Eval = section(Eval, split="train")
    ckpt: Ckpt = _ckpt(Ckpt, "sft")
    logger: Logger = _logger("sft")


@dataclass
class RMConfig(OptimFields, Launcher):
    """posttrain rm: reward-model training on preference pairs."""

    trainer: ClassVar[str] = "rm"
    adam: Adam = section(Adam, lr=9e-6)
    model: RMModel = section(RMModel)
    ds: DSHead = section(DSHead)
    data: PreferenceData = section(PreferenceData, max_len=512)
    train: Train = section(Train, micro_batch_size=1, max_epochs=1)
    eval: Eval = section(Eval, split="train")
    ckpt: Ckpt = _ckpt(Ckpt, "rm")
    logger: Logger = _logger("rm")


@dataclass
class DPOConfig(OptimFields, Launcher):
    """posttrain dpo: direct preference optimisation (DPO / IPO / cDPO)."""

    trainer: ClassVar[str] = "dpo"
    adam: Adam = section(Adam, lr=1e-5)
    model: DPOModel = section(DPOModel)
    ref: DPORef = section(DPORef)
    ds: DS = section(DS)
    data: PreferenceData = section(PreferenceData, max_len=512)
    train: Train = section(Train, micro_batch_size=8, max_epochs=1)
    eval: Eval = section(Eval, split="test")
    ckpt: Ckpt = _ckpt(Ckpt, "dpo")
    logger: Logger = _logger("dpo")


@dataclass
class PPOConfig(Launcher):
    """posttrain ppo: RL from human or verifiable feedback (PPO, REINFORCE++, RLOO, GRPO, ...)."""

    trainer: ClassVar[str] = "ppo"
    actor: Actor = section(Actor, adam=Adam(lr=1e-6))
    critic: Critic = section(Critic, adam=Adam(lr=9e-6), inert=NO_CRITIC)
    ref: Ref = section(Ref)
    reward: Reward = section(Reward)
    algo: Algo = section(Algo)
    ds: PPODS = section(PPODS)
    vllm: VLLM = section(VLLM)
    rollout: Rollout = section(Rollout)
    data: PPOData = section(PPOData, max_len=2048, max_samples=100000000)
    train: PPOTrain = section(PPOTrain, micro_batch_size=1, max_epochs=1, max_tokens_per_gpu=16192)
    agent: Agent = section(Agent)
    eval: PPOEval = section(PPOEval, split="train")
    ckpt: PPOCkpt = _ckpt(PPOCkpt, "ppo_ray", max_mem=float("inf"))
    logger: Logger = _logger("ppo")


CONFIG_CLASSES: dict[str, type] = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "ppo": PPOConfig}


def config_class(trainer: str) -> type:
    from posttrain.config.errors import ConfigError

    try:
        return CONFIG_CLASSES[trainer]
    except KeyError:
        raise ConfigError(f"unknown trainer {trainer!r}; valid: {', '.join(TRAINERS)}") from None


def default_config(trainer: str):
    """The config of `trainer` with every flag at its default (no validation)."""
    return config_class(trainer)()

