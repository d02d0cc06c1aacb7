"""Top-level configs, one per trainer, each with exactly the sections and defaults of the matching
OpenRLHF 0.10.2 entry point (train_sft / train_rm / train_dpo / train_ppo_ray), plus the posttrain
extensions marked in the section modules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.compat.trl_rloo import Translation
from posttrain.config import facts
from posttrain.config.data_sections import (
    PPODataConfig,
    PreferenceDataConfig,
    PRMDataConfig,
    SFTDataConfig,
    UnpairedDataConfig,
)
from posttrain.config.facts import Inert
from posttrain.config.inference import INFERENCE_CONFIGS, ChatConfig, EvalCmdConfig, GenerateConfig
from posttrain.config.roles import (
    NO_CRITIC,
    ActorConfig,
    AlgoConfig,
    CriticConfig,
    DPOModelConfig,
    DPORefConfig,
    KDModelConfig,
    KDTeacherConfig,
    KTOModelConfig,
    PRMModelConfig,
    RefConfig,
    RewardConfig,
    RMModelConfig,
    SFTModelConfig,
    TeacherConfig,
)
from posttrain.config.sections import (
    AdamConfig,
    AgentConfig,
    CkptConfig,
    DSConfig,
    EvalConfig,
    LoggerConfig,
    OptimizerFields,
    PPOCkptConfig,
    PPODSConfig,
    PPOEvalConfig,
    PPOTrainConfig,
    RolloutConfig,
    ScoreDSConfig,
    TrainConfig,
    VLLMConfig,
    WandbConfig,
)
from posttrain.config.serving import ServeRMConfig
from posttrain.config.spec import ParsedFields, carried, opt, section

TRAINERS = ("sft", "rm", "dpo", "ppo", "kd", "kto", "prm")


def _logger(trainer: str):
    return section(LoggerConfig, on_resume="volatile", wandb=WandbConfig(project=f"posttrain_{trainer}"))


def _ckpt(cls, trainer: str, **kw):
    # --ckpt.path stays unset (-> <--ckpt.output_dir>/checkpoints at start-up), not OpenRLHF's
    # ./ckpt/checkpoints_<trainer>, which every run started from one folder would share
    return section(cls, on_resume="volatile", **kw)


@dataclass
class LauncherFields(ParsedFields):
    """Flags set by launchers."""

    local_rank: int = opt(-1, "local rank (injected by the deepspeed launcher)",
                          inert=Inert("the device comes from the LOCAL_RANK environment variable the "
                                      "launcher sets", facts.launcher_sets_local_rank), on_resume="volatile")
    use_ms: bool = opt(False, "download models from ModelScope instead of the HF hub",
                       inert=Inert("ModelScope downloads are not supported; pass a local folder or an "
                                   "HF hub id"), on_resume="volatile")


@dataclass
class SFTConfig(OptimizerFields, LauncherFields):
    """posttrain sft: supervised fine-tuning."""

    trainer: ClassVar[str] = "sft"
    adam: AdamConfig = section(AdamConfig, lr=5e-6)
    model: SFTModelConfig = section(SFTModelConfig)
    ds: DSConfig = section(DSConfig)
    data: SFTDataConfig = section(SFTDataConfig, input_template="User: {}\nAssistant: ", max_len=2048)
    train: TrainConfig = section(TrainConfig, micro_batch_size=8, max_epochs=2)
    eval: EvalConfig = section(EvalConfig, on_resume="volatile", split="train")
    ckpt: CkptConfig = _ckpt(CkptConfig, "sft")
    logger: LoggerConfig = _logger("sft")


@dataclass
class RMConfig(OptimizerFields, LauncherFields):
    """posttrain rm: reward-model training on preference pairs."""

    trainer: ClassVar[str] = "rm"
    adam: AdamConfig = section(AdamConfig, lr=9e-6)
    model: RMModelConfig = section(RMModelConfig)
    ds: ScoreDSConfig = section(ScoreDSConfig)
    data: PreferenceDataConfig = section(PreferenceDataConfig, max_len=512)
    train: TrainConfig = section(TrainConfig, micro_batch_size=1, max_epochs=1)
    eval: EvalConfig = section(EvalConfig, on_resume="volatile", split="train")
    ckpt: CkptConfig = _ckpt(CkptConfig, "rm")
    logger: LoggerConfig = _logger("rm")


@dataclass
class DPOConfig(OptimizerFields, LauncherFields):
    """posttrain dpo: direct preference optimisation (DPO / IPO / cDPO)."""

    trainer: ClassVar[str] = "dpo"
    adam: AdamConfig = section(AdamConfig, lr=1e-5)
    model: DPOModelConfig = section(DPOModelConfig)
    ref: DPORefConfig = section(DPORefConfig)
    ds: DSConfig = section(DSConfig)
    data: PreferenceDataConfig = section(PreferenceDataConfig, max_len=512)
    train: TrainConfig = section(TrainConfig, micro_batch_size=8, max_epochs=1)
    eval: EvalConfig = section(EvalConfig, on_resume="volatile", split="test")
    ckpt: CkptConfig = _ckpt(CkptConfig, "dpo")
    logger: LoggerConfig = _logger("dpo")


@dataclass
class KDConfig(SFTConfig):
    """posttrain kd: knowledge distillation, SFT with a frozen teacher's token distributions (OpenRLHF 0.9's
    train_kd)."""

    trainer: ClassVar[str] = "kd"
    model: KDModelConfig = section(KDModelConfig)
    teacher: KDTeacherConfig = section(KDTeacherConfig)
    train: TrainConfig = section(TrainConfig, micro_batch_size=8, max_epochs=1)
    ckpt: CkptConfig = _ckpt(CkptConfig, "kd")
    logger: LoggerConfig = _logger("kd")


@dataclass
class KTOConfig(OptimizerFields, LauncherFields):
    """posttrain kto: KTO on unpaired rows (OpenRLHF 0.9's train_kto, TRL's KTOTrainer)."""

    trainer: ClassVar[str] = "kto"
    adam: AdamConfig = section(AdamConfig, lr=1e-5)
    model: KTOModelConfig = section(KTOModelConfig)
    ref: DPORefConfig = section(DPORefConfig)
    ds: DSConfig = section(DSConfig)
    data: UnpairedDataConfig = section(UnpairedDataConfig, max_len=512)
    train: TrainConfig = section(TrainConfig, micro_batch_size=8, max_epochs=1)
    eval: EvalConfig = section(EvalConfig, on_resume="volatile", split="test")
    ckpt: CkptConfig = _ckpt(CkptConfig, "kto")
    logger: LoggerConfig = _logger("kto")


@dataclass
class PRMConfig(OptimizerFields, LauncherFields):
    """posttrain prm: a process reward model on step-labelled rows (OpenRLHF 0.9's train_prm)."""

    trainer: ClassVar[str] = "prm"
    adam: AdamConfig = section(AdamConfig, lr=1e-6)
    model: PRMModelConfig = section(PRMModelConfig)
    ds: DSConfig = section(DSConfig)
    data: PRMDataConfig = section(PRMDataConfig, max_len=2048)
    train: TrainConfig = section(TrainConfig, micro_batch_size=1, max_epochs=1)
    eval: EvalConfig = section(EvalConfig, on_resume="volatile", split="test")
    ckpt: CkptConfig = _ckpt(CkptConfig, "prm")
    logger: LoggerConfig = _logger("prm")


@dataclass
class PPOConfig(LauncherFields):
    """posttrain ppo: RL from human or verifiable feedback (PPO, REINFORCE++, RLOO, GRPO, ...)."""

    trainer: ClassVar[str] = "ppo"
    actor: ActorConfig = section(ActorConfig, adam=AdamConfig(lr=1e-6))
    critic: CriticConfig = section(CriticConfig, adam=AdamConfig(lr=9e-6), inert=NO_CRITIC)
    ref: RefConfig = section(RefConfig)
    reward: RewardConfig = section(RewardConfig)
    algo: AlgoConfig = section(AlgoConfig)
    teacher: TeacherConfig = section(TeacherConfig)
    ds: PPODSConfig = section(PPODSConfig)
    vllm: VLLMConfig = section(VLLMConfig, on_resume="adjustable")
    rollout: RolloutConfig = section(RolloutConfig)
    data: PPODataConfig = section(PPODataConfig, max_len=2048, max_samples=100000000)
    train: PPOTrainConfig = section(PPOTrainConfig, micro_batch_size=1, max_epochs=1,
                                    max_tokens_per_gpu=16192)
    agent: AgentConfig = section(AgentConfig)
    eval: PPOEvalConfig = section(PPOEvalConfig, on_resume="volatile", split="train")
    ckpt: PPOCkptConfig = _ckpt(PPOCkptConfig, "ppo_ray", max_mem=float("inf"))
    logger: LoggerConfig = _logger("ppo")
    # not a flag: the field-by-field translation of the TRL RLOOConfig this config was made from
    # (`config_from_trl_rloo`, a TRL file given as --config), which the run prints and writes to its folder
    trl_translation: Translation | None = carried("the TRL RLOOConfig translation this config was made from")


# the configs a function may be passed, for its annotations
# the single-model trainers (trainers/session.py)
SingleModelConfig = SFTConfig | RMConfig | DPOConfig | KDConfig | KTOConfig | PRMConfig
TrainerConfig = SingleModelConfig | PPOConfig  # any trainer's
# any command's the dotted-flag parser reads (COMMAND_CONFIGS)
CommandConfig = TrainerConfig | ServeRMConfig | ChatConfig | GenerateConfig | EvalCmdConfig

CONFIG_CLASSES: dict[str, type] = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "ppo": PPOConfig,
                                   "kd": KDConfig, "kto": KTOConfig, "prm": PRMConfig}
# every command whose flags the dotted-flag parser reads: the trainers, the reward server, chat/generate/eval
COMMAND_CONFIGS: dict[str, type] = {**CONFIG_CLASSES, "serve-rm": ServeRMConfig, **INFERENCE_CONFIGS}


def config_class(command: str) -> type:
    from posttrain.config.errors import ConfigError

    try:
        return COMMAND_CONFIGS[command]
    except KeyError:
        raise ConfigError(f"unknown command {command!r}; valid: {', '.join(COMMAND_CONFIGS)}") from None


def default_config(trainer: str):
    """The config of `trainer` with every flag at its default (no validation)."""
    return config_class(trainer)()


def translation_of(cfg: CommandConfig) -> Translation | None:
    """The TRL translation `cfg` was made from (`PPOConfig.trl_translation`); None for a posttrain config."""
    return cfg.trl_translation if isinstance(cfg, PPOConfig) else None
