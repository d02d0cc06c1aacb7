"""posttrain.config: typed config sections mirroring OpenRLHF 0.10.2's dotted flags, the command-line
parser (with `--config run.yaml`), validation, hardware defaults and the start-up summary.

    cfg = parse_config("sft", ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"])
    cfg.ds.lora.rank, cfg.adam.lr, cfg.train.micro_batch_size, cfg.trainer == "sft"
"""

from posttrain.compat.trl_grpo import translate_trl
from posttrain.compat.trl_rloo import translate_rloo
from posttrain.config.errors import ConfigError, ConfigWarning, main_error_exit
from posttrain.config.fingerprint import adjustable_values, checkpoint_dir, run_fingerprint
from posttrain.config.flag_values import parse_probs
from posttrain.config.hardware import resolve_hardware_defaults, resolved_values
from posttrain.config.inert import inert_flags
from posttrain.config.parser import (
    build_parser,
    config_from_trl,
    config_from_trl_rloo,
    flag_owners,
    known_flags,
    load_config,
    parse_config,
)
from posttrain.config.roles import ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS
from posttrain.config.sections import LR_SCHEDULERS, OPTIMIZERS, PARAM_DTYPES
from posttrain.config.spec import FlagSpec, changed_values, flag_specs
from posttrain.config.summary import derived_sizes, format_config, format_set_flags
from posttrain.config.trainers import (
    CONFIG_CLASSES,
    TRAINERS,
    CommandConfig,
    DPOConfig,
    KDConfig,
    KTOConfig,
    PPOConfig,
    PRMConfig,
    RMConfig,
    SFTConfig,
    SingleModelConfig,
    TrainerConfig,
    config_class,
    default_config,
    translation_of,
)
from posttrain.config.validate import validate
from posttrain.config.yaml_io import config_to_dict, save_config

__all__ = [
    "config_from_trl",
    "config_from_trl_rloo",
    "translate_rloo",
    "translate_trl",
    "translation_of",
    "CONFIG_CLASSES",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LR_SCHEDULERS",
    "OPTIMIZERS",
    "PARAM_DTYPES",
    "TRAINERS",
    "CommandConfig",
    "ConfigError",
    "ConfigWarning",
    "DPOConfig",
    "KDConfig",
    "KTOConfig",
    "PRMConfig",
    "FlagSpec",
    "PPOConfig",
    "RMConfig",
    "SFTConfig",
    "SingleModelConfig",
    "TrainerConfig",
    "adjustable_values",
    "build_parser",
    "changed_values",
    "format_set_flags",
    "checkpoint_dir",
    "config_class",
    "config_to_dict",
    "default_config",
    "derived_sizes",
    "flag_owners",
    "flag_specs",
    "format_config",
    "inert_flags",
    "known_flags",
    "load_config",
    "main_error_exit",
    "parse_config",
    "parse_probs",
    "resolve_hardware_defaults",
    "resolved_values",
    "run_fingerprint",
    "save_config",
    "validate",
]
