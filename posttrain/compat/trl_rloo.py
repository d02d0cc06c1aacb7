"""TRL `RLOOConfig` as a posttrain PPO config, with TRL's semantics (TRL v0.14-v0.21, read against v0.21.0).

`translate_rloo(fields)` takes a mapping of TRL field names (an `rloo.yaml` of `trl/scripts`, the
fields of `RLOOConfig`, `ScriptArguments` and `ModelConfig`) or a `trl.RLOOConfig` object and returns a
`Translation`: posttrain flag values (dotted paths) and one `Line` per TRL field saying what it became,
or why it has no effect here. A field posttrain cannot honour raises `ConfigError`; nothing is dropped
silently. Fields the file leaves out take TRL's defaults where they change the training (rloo_k 2,
kl_coef 0.05, cliprange 0.2, num_ppo_epochs 4, temperature 0.7, response_length 53, learning_rate 5e-5,
per_device_train_batch_size 8, AdamW betas 0.9/0.999, a linear schedule without warm-up).

What TRL's RLOOTrainer does, and the posttrain settings that reproduce it:
- a rollout: `local_batch_size = per_device_train_batch_size * gradient_accumulation_steps *
  num_mini_batches` samples per process (`/ rloo_k` prompts, each sampled `rloo_k` times); the
  run lasts `ceil(total_episodes / (local_batch_size * world_size))` rollouts -> `--train.max_steps`;
- rewards: score, minus `missing_eos_penalty` without EOS, then (normalize_reward) batch-normalised
  and clamped to +-reward_clip_range, minus kl_coef * the summed k1 KL of the sequence (token_level_kl
  True or False give the same sum), leave-one-out baseline over rloo_k, (normalize_advantage)
  whitened over sequences -> `--algo.advantage.estimator rloo`, `--algo.kl.sequence_level_enable`;
- the update: `num_ppo_epochs` passes, each in `num_mini_batches` optimizer steps of
  `per_device_train_batch_size` micro-batches; loss = mean over sequences of the PPO-clipped
  exp(sum of the token log-ratios) -> `--actor.policy_loss_type seq_sum`; no gradient clipping
  outside DeepSpeed; the LR schedule over `num_total_batches`; fp32 weights.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

from posttrain.compat.trl_core import (  # noqa: F401 (Line, Translation: re-exported)
    Line,
    Translation,
    _adam,
    _Builder,
    _field_int,
    _field_number,
    _known_training_arguments,
    _lr_schedule,
    _numeric,
    _zero_stage,
)
from posttrain.utils.errors import ConfigError

TRL_VERSION = "v0.21.0"
REPORT_FILE = "trl_rloo_translation.txt"

# The fields of the seed's RLOOConfig (trl/trainer/rloo_config.py) and of OnPolicyConfig.
RLOO_FIELDS = ("exp_name", "reward_model_path", "num_ppo_epochs", "whiten_rewards", "kl_coef", "cliprange",
               "rloo_k", "normalize_reward", "reward_clip_range", "normalize_advantage", "token_level_kl",
               "ds3_gather_for_generation")
ON_POLICY_FIELDS = ("logging_steps", "bf16", "run_name", "dataset_num_proc", "num_mini_batches",
                    "total_episodes", "local_rollout_forward_batch_size", "num_sample_generations",
                    "response_length", "stop_token", "stop_token_id", "temperature", "missing_eos_penalty",
                    "sft_model_path", "world_size", "num_total_batches", "micro_batch_size",
                    "local_batch_size", "batch_size", "local_mini_batch_size", "mini_batch_size",
                    "push_to_hub")
SCRIPT_FIELDS = ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split",
                 "dataset_streaming", "gradient_checkpointing_use_reentrant", "ignore_bias_buffers")
MODEL_FIELDS = ("model_name_or_path", "model_revision", "torch_dtype", "trust_remote_code",
                "attn_implementation", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
                "lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "lora_task_type",
                "use_rslora", "use_dora", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type",
                "use_bnb_nested_quant")
# Keys that only a TRL RLOO file has (a posttrain file's top-level keys are sections or dotted flags).
MARKERS = frozenset(RLOO_FIELDS + ON_POLICY_FIELDS + ("learning_rate", "per_device_train_batch_size",
                                                      "gradient_accumulation_steps", "model_name_or_path",
                                                      "dataset_name"))

# TRL v0.21.0 / transformers defaults of the fields that shape the training.
DEFAULTS: dict[str, Any] = {
    "rloo_k": 2, "kl_coef": 0.05, "cliprange": 0.2, "num_ppo_epochs": 4, "normalize_reward": False,
    "reward_clip_range": 10.0, "normalize_advantage": False, "token_level_kl": False, "whiten_rewards": False,
    "ds3_gather_for_generation": True, "num_mini_batches": 1, "total_episodes": None,
    "local_rollout_forward_batch_size": 64, "response_length": 53, "stop_token": None, "stop_token_id": None,
    "temperature": 0.7, "missing_eos_penalty": None, "learning_rate": 5e-5, "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1, "num_train_epochs": 3.0, "weight_decay": 0.0, "adam_beta1": 0.9,
    "adam_beta2": 0.999, "adam_epsilon": 1e-8, "lr_scheduler_type": "linear", "warmup_ratio": 0.0,
    "warmup_steps": 0, "seed": 42, "dataset_train_split": "train", "bf16": True,
}
_COMPUTED = ("computed by TRL at start-up from the batch fields (the file's value is overwritten); posttrain "
             "derives it too")
_NO_EFFECT = {
    "whiten_rewards": "no effect: TRL's RLOOTrainer never reads it",
    "token_level_kl": "no effect: TRL sums the token-level KL rewards into the sequence return before the "
                      "baseline, the same sum as the sequence-level KL (--algo.kl.sequence_level_enable); "
                      "the field's default is False although its docstring says True",
    "exp_name": "no effect: names TRL's run (exp_name__seed__time); posttrain's run is --ckpt.output_dir",
    "run_name": "no effect: TRL overwrites it with exp_name__seed__time; use --logger.wandb.run_name",
    "dataset_num_proc": "no effect: posttrain tokenizes prompts in the trainer process",
    "num_sample_generations": "no effect: TRL's sample-completion tables; posttrain logs rollouts in "
                              "metrics.jsonl",
    "dataset_test_split": "no effect: TRL's rloo.py holds out the last 100 training rows instead; use "
                          "--eval.dataset",
    "dataset_streaming": "no effect: rloo.py loads the dataset whole, as posttrain does",
    "ignore_bias_buffers": "no effect: rloo.py does not read it",
    "gradient_checkpointing_use_reentrant": "no effect: rloo.py does not read it "
                                            "(--actor.gradient_checkpointing_reentrant)",
    "model_revision": "no effect: rloo.py loads the policy from sft_model_path without it",
    "torch_dtype": "no effect: rloo.py loads the models without it; posttrain resolves --ds.param_dtype per "
                   "device",
    "trust_remote_code": "no effect here: posttrain loads local Hugging Face checkpoints",
    "attn_implementation": "no effect: rloo.py does not pass it; posttrain resolves --ds.attn_implementation "
                           "per device",
    "max_grad_norm": "no effect: RLOOTrainer steps the optimizer without clipping (--actor.max_norm 0)",
    "num_train_epochs": "no effect: total_episodes is set",
    "report_to": "no effect: posttrain always writes metrics.jsonl; W&B with --logger.wandb.*, TensorBoard "
                 "with --logger.tensorboard_dir",
    "push_to_hub": "no effect: posttrain writes the model to --ckpt.output_dir and never uploads",
    "env": "no effect: TrlParser's environment variables; set them in the shell",
}
for _name in ("world_size", "num_total_batches", "micro_batch_size", "local_batch_size", "batch_size",
              "local_mini_batch_size", "mini_batch_size"):
    _NO_EFFECT[_name] = f"no effect: {_COMPUTED}"
for _name in MODEL_FIELDS:
    if _name.startswith(("use_peft", "lora_", "use_rslora", "use_dora", "load_in_", "bnb_", "use_bnb")):
        _NO_EFFECT[_name] = ("no effect: TRL's rloo.py never passes a PEFT or quantisation config to "
                             "RLOOTrainer")


def is_trl_rloo(data: Mapping) -> bool:
    """A config file is a TRL RLOO file when one of its top-level keys is a TRL field that posttrain
    has no top-level key for (`rloo_k`, `kl_coef`, `sft_model_path`, `per_device_train_batch_size`, ...)."""
    return any(isinstance(k, str) and k in MARKERS for k in data)


def fields_of(config: Any) -> dict[str, Any]:
    """The fields a TRL config sets: a mapping as given, or the fields of a `trl.RLOOConfig` (any
    dataclass) whose value differs from the class default."""
    if isinstance(config, Mapping):
        return dict(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        if not hasattr(config, "rloo_k"):
            raise ConfigError(f"{type(config).__name__} has no rloo_k: it is not the RLOOConfig of TRL "
                              f"v0.14-v0.21 (TRL 0.22+ rebuilt RLOO on GRPO's config); pass the fields as a "
                              f"dict instead")
        out = {}
        for f in dataclasses.fields(config):
            default = (f.default if f.default is not dataclasses.MISSING
                       else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            value = getattr(config, f.name)
            if value != default and f.init:
                out[f.name] = value.value if hasattr(value, "value") and not isinstance(value, str) else value
        return out
    raise ConfigError(f"a TRL RLOO config must be a mapping or a trl.RLOOConfig, got {type(config).__name__}")


def _batches(b: _Builder, world_size: int) -> None:
    per_device = _field_int("per_device_train_batch_size", b.get("per_device_train_batch_size"))
    accumulation = _field_int("gradient_accumulation_steps", b.get("gradient_accumulation_steps"))
    mini = _field_int("num_mini_batches", b.get("num_mini_batches"))
    k = _field_int("rloo_k", b.get("rloo_k"), minimum=2)
    local = per_device * accumulation * mini
    if local % k:
        raise ConfigError(f"TRL fields: local_batch_size = per_device_train_batch_size x "
                          f"gradient_accumulation_steps x num_mini_batches = {local} must be a multiple of "
                          f"rloo_k {k} (TRL refuses it too)")
    samples = local * world_size
    where = f"{world_size} processes" if world_size > 1 else "one process"
    b.set("rloo_k", {"rollout.n_samples_per_prompt": k, "algo.advantage.estimator": "rloo"},
          "leave-one-out baseline over the group")
    b.set("per_device_train_batch_size", {"train.micro_batch_size": per_device})
    b.set("gradient_accumulation_steps", {"rollout.batch_size": samples // k},
          f"a rollout = per_device x accumulation x num_mini_batches x {where} = {samples} samples = "
          f"{samples // k} prompts x rloo_k")
    b.set("num_mini_batches", {"train.batch_size": samples // mini},
          f"{mini} optimizer step(s) per pass over the rollout")
    b.set("num_ppo_epochs", {"train.max_epochs": _field_int("num_ppo_epochs", b.get("num_ppo_epochs"))})
    episodes = b.get("total_episodes")
    if episodes is None:
        raise ConfigError("TRL field total_episodes is not set: TRL derives it as num_train_epochs x the "
                          "size of the training dataset, which posttrain does not know before loading it; "
                          "write total_episodes: <num_train_epochs x number of training prompts> in the file")
    rollouts = math.ceil(_field_int("total_episodes", episodes) / samples)
    b.set("total_episodes", {"train.max_steps": rollouts},
          f"ceil(total_episodes / {samples}) rollouts, cycling the prompts as TRL's dataloader does")
    if "num_train_epochs" in b.given:
        b.line("num_train_epochs", _NO_EFFECT["num_train_epochs"])
    b.set("local_rollout_forward_batch_size", {"rollout.micro_batch_size": _field_int(
        "local_rollout_forward_batch_size", b.get("local_rollout_forward_batch_size"))}, always=False)


def _algorithm(b: _Builder) -> None:
    b.set("kl_coef", {"algo.kl.init_coef": _field_number("kl_coef", b.get("kl_coef")),
                      "algo.kl.estimator": "k1", "algo.kl.sequence_level_enable": True,
                      "algo.kl.use_loss": False, "algo.kl.clamp": 0.0, "reward.clip_range": [-1e9, 1e9]},
          "KL = summed log-ratio of the sequence, unclamped, subtracted from the score before the baseline; "
          "TRL clips no reward after the baseline")
    b.line("token_level_kl", _NO_EFFECT["token_level_kl"])
    clip = _field_number("cliprange", b.get("cliprange"))
    b.set("cliprange", {"actor.eps_clip": clip, "actor.policy_loss_type": "seq_sum"},
          "ratio = exp(sum of the token log-ratios of a sequence), mean over sequences")
    b.set("normalize_reward", {"reward.batch_normalize_enable": bool(b.get("normalize_reward"))},
          "(score - batch mean) / (unbiased std + 1e-8)")
    b.set("reward_clip_range",
          {"reward.batch_normalize_clip": _field_number("reward_clip_range", b.get("reward_clip_range"))},
          "clamps the normalised scores only")
    normalize = bool(b.get("normalize_advantage"))
    b.set("normalize_advantage",
          {"algo.advantage.whiten_enable": normalize, "algo.advantage.whiten_level": "sequence"},
          "one advantage per sequence, / (unbiased std + 1e-8)")
    b.line("whiten_rewards", _NO_EFFECT["whiten_rewards"])
    penalty = b.get("missing_eos_penalty")
    b.set("missing_eos_penalty", {"reward.missing_eos_penalty": None if penalty is None else
                                  _field_number("missing_eos_penalty", penalty)},
          "subtracted from the score without EOS")
    b.set("bf16", {"ds.param_dtype": "fp32"}, "rloo.py loads every model in fp32 and bf16 is autocast over "
          "fp32 weights and optimizer state; posttrain's bf16 keeps no fp32 copy in one process, so fp32 "
          "here")
    if "fp16" in b.given:
        b.line("fp16", "as bf16: fp32 weights here")
    b.set("ds3_gather_for_generation", {"ds.gather_for_generation": bool(b.get("ds3_gather_for_generation"))},
          "read under ZeRO-3 with several actor ranks; one process trains without ZeRO")


def _sampling(b: _Builder) -> None:
    b.set("response_length",
          {"rollout.max_new_tokens": _field_int("response_length", b.get("response_length"))})
    b.set("temperature", {"rollout.temperature": _field_number("temperature", b.get("temperature"))},
          "also divides the training logits; TRL adds 1e-7")
    stop, stop_id = b.get("stop_token"), b.get("stop_token_id")
    if stop is not None and stop != "eos":
        raise ConfigError(f"TRL field stop_token: {stop!r} must be 'eos' or unset")
    if stop is not None and stop_id is not None:
        raise ConfigError("TRL fields stop_token and stop_token_id are mutually exclusive; keep one")
    if stop == "eos":
        b.set("stop_token", {"rollout.stop_token_ids": None}, "a sample ends at the tokenizer's EOS")
    elif stop_id is not None:
        b.set("stop_token_id", {"rollout.stop_token_ids": [_field_int("stop_token_id", stop_id, minimum=0)]},
              "a sample ends at this token")
    else:
        b.set("stop_token", {"rollout.stop_token_ids": []},
              "TRL generates all response_length tokens, past EOS, and keeps them")
    b.done |= {"stop_token", "stop_token_id"}


def _optimizer(b: _Builder) -> None:
    deepspeed = "deepspeed" in b.given
    clip = _field_number("max_grad_norm", b.given.get("max_grad_norm", 1.0)) if deepspeed else 0.0
    _adam(b, clip, "AdamW; " + ("under DeepSpeed the gradients are clipped at max_grad_norm ('auto')" if
                               deepspeed else "TRL's loop clips no gradient outside DeepSpeed"))
    if deepspeed or "max_grad_norm" in b.given:
        b.line("max_grad_norm", "with learning_rate" if deepspeed else _NO_EFFECT["max_grad_norm"])
    _schedule(b)


def _schedule(b: _Builder) -> None:
    """transformers' `get_scheduler(lr_scheduler_type, warm-up, num_total_batches, **lr_scheduler_kwargs)`,
    stepped once per rollout. The warm-up is carried as an integer count of posttrain optimizer steps:
    TRL's warm-up rollouts (`warmup_steps`, else `ceil(rollouts x warmup_ratio)` as TrainingArguments
    computes it) x the optimizer steps of one rollout (num_ppo_epochs x num_mini_batches), so the warm-up
    ends at the first update of the same rollout as in TRL."""
    name = _lr_schedule(b, "over the run's optimizer steps; TRL steps it once per rollout, the same when "
                           "there is one optimizer step per rollout")
    if name == "constant":
        return
    rollouts = b.out.values["train.max_steps"]
    per_rollout = b.out.values["train.max_epochs"] * math.ceil(
        b.out.values["rollout.batch_size"] * b.out.values["rollout.n_samples_per_prompt"]
        / b.out.values["train.batch_size"])
    steps = _field_int("warmup_steps", b.get("warmup_steps"), minimum=0)
    ratio = _field_number("warmup_ratio", b.get("warmup_ratio"))
    warmup = steps if steps else math.ceil(rollouts * ratio)
    why = (f"{warmup} warm-up rollout(s) x {per_rollout} optimizer step(s) per rollout (num_ppo_epochs x "
           "num_mini_batches)")
    b.set("warmup_steps" if steps else "warmup_ratio", {"actor.lr_warmup_steps": warmup * per_rollout},
          why + ("" if steps else f"; ceil(rollouts {rollouts} x warmup_ratio) rollouts, as TRL"))
    b.line("warmup_ratio" if steps else "warmup_steps",
           "no effect: warmup_steps > 0 wins over it, as in "
           "TRL" if steps else "0: the warm-up comes from warmup_ratio", always=False)


def _trl_steps(b: _Builder, name: str, value: Any) -> int:
    """A step count of TrainingArguments (logging_steps, save_steps): a ratio in (0, 1) is of TRL's
    `state.max_steps = num_total_batches * num_mini_batches // 2`; TRL's global step counts rollouts."""
    value = _numeric(value)
    if isinstance(value, float) and 0 < value < 1:
        max_steps = b.out.values["train.max_steps"] * _field_int("num_mini_batches",
                                                                 b.get("num_mini_batches")) // 2
        return max(1, math.ceil(max_steps * value))
    return _field_int(name, value)


def _models_and_data(b: _Builder) -> None:
    policy = b.given.get("sft_model_path") or b.given.get("model_name_or_path")
    if policy is None:
        raise ConfigError("TRL fields sft_model_path and model_name_or_path are both unset: name the policy "
                          "checkpoint (TRL's default EleutherAI/pythia-160m is not fetched here)")
    why = "policy and reference" + ("" if "sft_model_path" in b.given else
                                    "; sft_model_path unset, so model_name_or_path (TRL would load "
                                    "pythia-160m)")
    b.out.values["actor.model_name_or_path"] = policy
    b.line("sft_model_path", f"--actor.model_name_or_path {policy} ({why})", always=False)
    b.done.add("sft_model_path")
    if "model_name_or_path" in b.given:
        b.line("model_name_or_path", "the tokenizer in rloo.py; posttrain reads the tokenizer of the policy "
                                     "checkpoint"
               if "sft_model_path" in b.given else f"--actor.model_name_or_path {policy}")
    if "reward_model_path" in b.given:
        b.set("reward_model_path", {"reward.model_name_or_path": b.given["reward_model_path"]})
    if "dataset_name" in b.given:
        b.set("dataset_name", {"data.prompt_dataset": b.given["dataset_name"], "data.input_key": "prompt",
                               "data.apply_chat_template": False},
              "rloo.py tokenizes the raw 'prompt' column; it also holds out the last 100 rows for "
              "evaluation, posttrain trains on all of them")
    if b.given.get("dataset_config") is not None:
        raise ConfigError("TRL field dataset_config: posttrain loads a dataset path or name without a config "
                          "name; point dataset_name at the files of that configuration")
    b.done.add("dataset_config")
    b.set("dataset_train_split", {"data.prompt_split": b.get("dataset_train_split")}, always=False)
    b.set("seed", {"train.seed": _field_int("seed", b.get("seed"), minimum=0)}, always=False)
    if "output_dir" in b.given:
        b.set("output_dir", {"ckpt.output_dir": b.given["output_dir"]})
    if "gradient_checkpointing" in b.given:
        b.set("gradient_checkpointing",
              {"actor.gradient_checkpointing_enable": bool(b.given["gradient_checkpointing"])},
              "memory only; TRL's RLOOTrainer never turns it on")
    if "logging_steps" in b.given:
        b.set("logging_steps",
              {"logger.logging_steps": _trl_steps(b, "logging_steps", b.given["logging_steps"])})
    if "save_steps" in b.given or "save_strategy" in b.given:
        strategy = b.given.get("save_strategy", "steps")
        if strategy == "no":
            b.line("save_strategy", "no resumable checkpoints (posttrain's default: --ckpt.save_steps -1)")
        elif strategy == "steps":
            every = _trl_steps(b, "save_steps", b.given.get("save_steps", 500))
            b.set("save_steps", {"ckpt.save_steps": every}, "a resumable checkpoint every N rollouts")
            b.done.add("save_strategy")
        else:
            raise ConfigError(f"TRL field save_strategy: {strategy!r} has no posttrain equivalent; use "
                              f"'steps' or 'no'")
        b.done |= {"save_steps", "save_strategy"}
    if "deepspeed" in b.given:
        b.set("deepspeed", {"ds.zero_stage": _zero_stage(b.given["deepspeed"])},
              "the ZeRO stage of the DeepSpeed "
              "config; the rest of it is posttrain's (--ds.*)")


def translate_rloo(config: Any, world_size: int = 1) -> Translation:
    """posttrain ppo flag values and a field-by-field report for a TRL RLOO config (a mapping of
    field names or a `trl.RLOOConfig`); `world_size` = the actor's processes (TRL's accelerate
    processes). Raises ConfigError naming every field that posttrain cannot honour."""
    b = _Builder(fields_of(config), DEFAULTS)
    _batches(b, world_size)
    _algorithm(b)
    _sampling(b)
    _optimizer(b)
    _models_and_data(b)
    rest = [name for name in b.given if name not in b.done]
    known = (set(RLOO_FIELDS + ON_POLICY_FIELDS + SCRIPT_FIELDS + MODEL_FIELDS) | _known_training_arguments()
             | {"env"})
    problems = []
    for name in rest:
        if name in _NO_EFFECT:
            b.line(name, _NO_EFFECT[name])
        elif name in known:
            b.line(name, "no effect: a transformers TrainingArguments field that TRL's RLOOTrainer loop does "
                         "not read for the training itself (logging, saving, evaluation or hub plumbing)")
        else:
            close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.75)
            problems.append(f"unknown TRL field {name!r}" + (f"; did you mean {close[0]!r}?" if close else
                                                            " (not a field of RLOOConfig, ScriptArguments or "
                                                            "ModelConfig)"))
    if problems:
        raise ConfigError.collect(problems, header="TRL RLOO config")
    return b.out

