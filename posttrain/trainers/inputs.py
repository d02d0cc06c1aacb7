"""The files and folders a run names, checked together at start-up, before anything is printed or
written: `check_inputs(cfg)` raises one ConfigError naming every model path (model, reference, critic,
reward model), dataset (training, prompts, eval) and reward / agent file that is missing or broken;
the loads that follow (tokenizer, rows, data keys) raise their own errors, still before the echo."""
from __future__ import annotations

import os

from posttrain.config import TrainerConfig, flag_specs
from posttrain.config.spec import get_path
from posttrain.data.sources import missing_source
from posttrain.models import check_model_folder
from posttrain.utils.errors import ConfigError, UserError

MODEL_FLAGS = ("model.model_name_or_path", "actor.model_name_or_path", "critic.model_name_or_path",
               "ref.model_name_or_path", "reward.model_name_or_path")
DATA_FLAGS = ("data.dataset", "data.prompt_dataset", "eval.dataset")
FILE_FLAGS = ("reward.remote_url", "train.agent_func_path")  # local .py files (a URL is checked when called)


def input_problems(cfg: TrainerConfig) -> list[str]:
    """One line per missing or broken input of `cfg` (each names its flag), in flag order."""
    paths = {spec.path for spec in flag_specs(type(cfg))}
    problems = []
    for flag in MODEL_FLAGS:
        value = get_path(cfg, flag) if flag in paths else None
        if value:
            try:
                check_model_folder(value)
            except (UserError, FileNotFoundError) as e:
                problems.append(f"--{flag}: {e}")
    for flag in DATA_FLAGS:
        value = get_path(cfg, flag) if flag in paths else None
        for name in (value or "").split(",") if isinstance(value, str) else value or ():
            problem = missing_source(name.strip()) if name.strip() else None
            if problem:
                problems.append(f"--{flag}: {problem}")
    for flag in FILE_FLAGS:
        value = get_path(cfg, flag) if flag in paths else None
        if isinstance(value, str) and value.endswith(".py") and "://" not in value \
                and not os.path.isfile(os.path.expanduser(value)):
            problems.append(f"--{flag}: no such file {os.path.abspath(os.path.expanduser(value))}")
    return problems


def check_inputs(cfg: TrainerConfig) -> None:
    """Raise one ConfigError listing every problem of `input_problems` (nothing when all are fine)."""
    problems = input_problems(cfg)
    if problems:
        raise ConfigError.collect(problems, header="missing or broken inputs")
