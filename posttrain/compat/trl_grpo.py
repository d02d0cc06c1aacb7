"""TRL 1.x `GRPOConfig` and the GRPO-based `RLOOConfig` as a posttrain PPO config (read against TRL 1.16.0).

`translate_trl(config)` takes a mapping of TRL field names (a `trl grpo` / `trl rloo` YAML: the config's
fields with `ScriptArguments`, `ModelConfig` and grpo.py's reward fields) or a TRL config object, picks
the config by its keys (`trl_kind`), and returns a `Translation` as `trl_rloo.translate_rloo` does for
TRL <= 0.21. A field with no posttrain equivalent is reported when its value cannot change the training,
and is a `ConfigError` naming it when it would.

What TRL 1.16's trainers do, and the posttrain settings that reproduce it:
- a generation batch of `generation_batch_size` samples (default `per_device_train_batch_size x
  processes x steps_per_generation`, `steps_per_generation` defaulting to `gradient_accumulation_steps`)
  = `/ num_generations` prompts -> `--rollout.batch_size`; an optimizer step takes `per_device x
  accumulation x processes` of them -> `--train.batch_size`; the batch is used `num_iterations` times ->
  `--train.max_epochs`; `max_steps` optimizer steps -> `--train.max_steps` rollouts;
- GRPO advantages: `(r - group mean) / (unbiased group std + 1e-4)` (`scale_rewards: group`) ->
  `group_norm` with `--algo.advantage.std_eps 1e-4`, or `r - group mean` (`none`) -> `dr_grpo`;
  RLOO: the score minus `beta x` the summed k1 KL, leave-one-out baseline, optionally whitened over the
  batch (`/ (std + 1e-4)`) -> `rloo`, `--algo.kl.sequence_level_enable`;
- GRPO loss: PPO-clipped token (or, `importance_sampling_level: sequence`, GSPO's sequence-mean) ratio,
  plus `beta x` k3 KL per token, aggregated by `loss_type` -> `--actor.loss_agg`; RLOO: the clipped
  sequence ratio `exp(sum of log-ratios)`, mean over sequences -> `--actor.policy_loss_type seq_sum`;
- AdamW with transformers' schedule stepped per optimizer step, the gradient clipped at max_grad_norm.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from posttrain.compat.trl_core import (
    Translation,
    _adam,
    _Builder,
    _field_int,
    _field_number,
    _known_training_arguments,
    _lr_schedule,
    _zero_stage,
)
from posttrain.compat.trl_rloo import MARKERS as RLOO_MARKERS
from posttrain.compat.trl_rloo import (
    MODEL_FIELDS,
    ON_POLICY_FIELDS,
    RLOO_FIELDS,
    SCRIPT_FIELDS,
    translate_rloo,
)
from posttrain.utils.errors import ConfigError

TRL_VERSION = "v1.16.0"
REPORT_FILES = {"grpo": "trl_grpo_translation.txt", "rloo": "trl_rloo_translation.txt"}

# TRL 1.16's defaults of the fields of GRPOConfig / RLOOConfig (beyond TrainingArguments) that the
# translation reads; the two configs differ in num_generations, beta and loss_type.
_SHARED_DEFAULTS: dict[str, Any] = {
    "num_generations": 8, "max_completion_length": 512, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "min_p": None, "repetition_penalty": 1.0, "generation_kwargs": None, "beta": 0.0, "num_iterations": 1,
    "epsilon": 0.2, "epsilon_high": None, "generation_batch_size": None, "steps_per_generation": None,
    "ds3_gather_for_generation": True, "reward_weights": None, "num_generations_eval": None,
    "learning_rate": 1e-6, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "max_steps": -1, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
    "lr_scheduler_type": "linear", "warmup_steps": 0, "max_grad_norm": 1.0, "seed": 42, "bf16": None,
    "dataset_train_split": "train", "scale_rewards": "group", "loss_type": "dapo",
    "importance_sampling_level": "token", "delta": None, "normalize_advantages": False,
    "reward_clip_range": None, "logging_steps": 10, "gradient_checkpointing": True,
}
DEFAULTS = {"grpo": _SHARED_DEFAULTS, "rloo": {**_SHARED_DEFAULTS, "num_generations": 2, "beta": 0.05}}

# Fields with no posttrain equivalent that change the training unless at this (TRL's default) value.
_REFUSED: dict[str, tuple[Any, str]] = {
    "top_k": (0, "posttrain samples without a top-k cut"),
    "min_p": (None, "posttrain samples without a min-p cut"),
    "repetition_penalty": (1.0, "posttrain samples without a repetition penalty"),
    "generation_kwargs": (None, "posttrain's sampling takes --rollout.temperature / --rollout.top_p only"),
    "mask_truncated_completions": (False, "posttrain keeps truncated completions in the loss"),
    "top_entropy_quantile": (1.0, "posttrain has no high-entropy token mask"),
    "off_policy_mask_threshold": (None, "posttrain has no off-policy sequence mask"),
    "multi_objective_aggregation": ("sum_then_normalize", "posttrain sums the weighted rewards first"),
    "use_adaptive_entropy": (False, "posttrain's entropy coefficient is fixed (--actor.entropy_coef)"),
    "sync_ref_model": (False, "posttrain's reference model stays fixed"),
    "disable_dropout": (False, "posttrain trains with the checkpoint's dropout"),
    "cast_lm_head_to_fp32": (False, "posttrain computes the logits in the model's dtype"),
    "router_aux_loss_coef": (None, "give the MoE router loss with posttrain's model flags"),
    "vllm_structured_outputs_regex": (None, "posttrain samples without constrained decoding"),
    "chat_template_kwargs": (None, "posttrain applies the tokenizer's chat template as is"),
    "shuffle_dataset": (True, "posttrain shuffles the prompts"),
    "reward_clip_range": (None, "posttrain clips rewards after the baseline only (--reward.clip_range)"),
    "use_peft": (False, "LoRA is posttrain's --ds.lora.* (a different set-up); give it there"),
    "load_in_4bit": (False, "posttrain trains without quantisation"),
    "load_in_8bit": (False, "posttrain trains without quantisation"),
}
_NO_EFFECT = {
    "use_vllm": "no effect on the update: posttrain samples with its rollout engines (--vllm.*)",
    "num_generations_eval": "no effect without an evaluation set (--eval.n_samples_per_prompt)",
    "cache_implementation": "no effect: generation cache plumbing",
    "pad_to_multiple_of": "no effect: padding only",
    "model_init_kwargs": "no effect here: posttrain loads the checkpoint with --ds.param_dtype",
    "trust_remote_code": "no effect here: posttrain loads local Hugging Face checkpoints",
    "max_tool_calling_iterations": "no effect: TRL's tool loop; posttrain's is --agent.*",
    "reward_funcs": "not read: give each function as --reward.func_path file.py:function (called as TRL "
                    "calls it)",
    "report_to": "no effect: posttrain always writes metrics.jsonl (W&B: --logger.wandb.*)",
    "push_to_hub": "no effect: posttrain writes the model to --ckpt.output_dir and never uploads",
    "num_train_epochs": "no effect: max_steps is set",
    "fp16": "as bf16: fp32 weights here",
    "env": "no effect: TrlParser's environment variables; set them in the shell",
}
_PLUMBING = ("vllm_", "log_", "num_completions_to_print", "use_transformers_", "transformers_continuous",
             "sapo_", "vespo_", "entropy_coef_", "entropy_target", "ref_model_", "use_bias_correction_kl",
             "lora_", "use_rslora", "use_dora", "bnb_", "use_bnb", "dataset_", "model_revision", "dtype",
             "torch_dtype", "attn_implementation", "ignore_bias_buffers",
             "gradient_checkpointing_use_reentrant")
# Keys only a TRL 1.x GRPO/RLOO file has (shared with neither TRL <= 0.21's RLOOConfig nor posttrain).
MARKERS_1X = frozenset(("num_generations", "max_completion_length", "beta", "num_iterations", "epsilon",
                        "epsilon_high", "loss_type", "scale_rewards", "importance_sampling_level",
                        "generation_batch_size", "steps_per_generation", "reward_funcs", "reward_weights",
                        "mask_truncated_completions", "use_vllm", "normalize_advantages",
                        "reward_model_name_or_path", "max_steps"))
_RLOO_ONLY = frozenset(("normalize_advantages", "reward_clip_range"))
# GRPOConfig's fields that TRL 1.16's RLOOConfig lacks (TRL's own parser refuses them in an RLOO file)
_GRPO_ONLY = frozenset((
    "cast_lm_head_to_fp32", "delta", "entropy_coef", "entropy_coef_delta", "entropy_coef_max",
    "entropy_coef_min", "entropy_target", "importance_sampling_level", "log_completions_hub_repo",
    "loss_type", "max_tool_calling_iterations", "multi_objective_aggregation", "off_policy_mask_threshold",
    "sapo_temperature_neg", "sapo_temperature_pos", "scale_rewards", "top_entropy_quantile",
    "use_adaptive_entropy", "use_bias_correction_kl", "vespo_k_neg", "vespo_k_pos", "vespo_lambda_neg",
    "vespo_lambda_pos", "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode"))
AMBIGUOUS = ("no field that only one of GRPOConfig and RLOOConfig has: read as a GRPOConfig; add "
             "`normalize_advantages: false` (RLOOConfig's default) to read it as an RLOOConfig")
_OLD_ONLY = frozenset(RLOO_FIELDS + ON_POLICY_FIELDS) - {"temperature", "ds3_gather_for_generation",
                                                         "reward_clip_range", "logging_steps", "bf16",
                                                         "run_name", "push_to_hub"}
# loss_type -> (--actor.loss_agg, why)
_LOSS_AGG = {
    "dapo": ("token_mean", "mean over every completion token of the optimizer step"),
    "bnpo": ("token_mean", "mean over the completion tokens of a micro-batch"),
    "grpo": ("seq_mean_token_mean", "each completion's token mean, mean over completions"),
    "dr_grpo": ("seq_sum_norm", "sum over tokens / (completions x max_completion_length)"),
    "luspo": ("seq_mean_token_sum", "each completion's token sum, mean over completions"),
}


def is_trl_config(data: Mapping) -> bool:
    """A config file is TRL's when one of its top-level keys is a TRL field posttrain has no key for."""
    return any(isinstance(k, str) and (k in RLOO_MARKERS or k in MARKERS_1X) for k in data)


def trl_kind(config: Any) -> str:
    """"rloo<=0.21", "grpo" or "rloo" (1.x): a config object by its class, a mapping by its keys (keys
    of both TRL 1.x and TRL <= 0.21 raise; `normalize_advantages` or `reward_clip_range` make a 1.x file an
    RLOOConfig, beside a GRPOConfig-only field they raise; a file with neither kind is a GRPOConfig, and its
    translation's title says so: `AMBIGUOUS`)."""
    if not isinstance(config, Mapping):
        if hasattr(config, "rloo_k"):
            return "rloo<=0.21"
        name = type(config).__name__
        if dataclasses.is_dataclass(config) and hasattr(config, "num_generations"):
            return "rloo" if "RLOO" in name else "grpo"
        raise ConfigError(f"a TRL config must be a mapping, a GRPOConfig or an RLOOConfig, got {name}")
    keys = {k for k in config if isinstance(k, str)}
    new, old = sorted(keys & MARKERS_1X), sorted(keys & _OLD_ONLY)
    if new and old:
        raise ConfigError(f"TRL fields of TRL 1.x ({', '.join(new)}) mixed with fields of TRL <= 0.21's "
                          f"RLOOConfig ({', '.join(old)}); keep the fields of one TRL version")
    if not new:
        return "rloo<=0.21"
    rloo, grpo = sorted(keys & _RLOO_ONLY), sorted(keys & _GRPO_ONLY)
    if rloo and grpo:
        raise ConfigError(f"TRL fields of RLOOConfig only ({', '.join(rloo)}) mixed with fields of "
                          f"GRPOConfig only ({', '.join(grpo)}); keep the fields of one TRL config")
    return "rloo" if rloo else "grpo"


def _nondefault(config: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config):
        default = (f.default if f.default is not dataclasses.MISSING
                   else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        value = getattr(config, f.name)
        if f.init and value != default:
            out[f.name] = value.value if hasattr(value, "value") and not isinstance(value, str) else value
    return out


def translate_trl(config: Any, world_size: int = 1) -> Translation:
    """The translation of any supported TRL config (`trl_kind`); `world_size` = TRL's processes."""
    kind = trl_kind(config)
    if kind == "rloo<=0.21":
        return translate_rloo(config, world_size)
    given = dict(config) if isinstance(config, Mapping) else _nondefault(config)
    title = f"TRL {'GRPOConfig' if kind == 'grpo' else 'RLOOConfig'} ({TRL_VERSION} semantics)"
    if kind == "grpo" and isinstance(config, Mapping) and not set(config) & _GRPO_ONLY:
        title += f" ({AMBIGUOUS})"
    b = _Builder(given, DEFAULTS[kind], Translation(title=title, file=REPORT_FILES[kind]))
    _batches(b, world_size, kind)
    (_grpo_algorithm if kind == "grpo" else _rloo_algorithm)(b)
    _sampling(b)
    clip = _field_number("max_grad_norm", b.get("max_grad_norm"))
    _adam(b, clip, "AdamW; the Trainer clips the gradient norm at max_grad_norm")
    b.line("max_grad_norm", "with learning_rate", always=False)
    _warmup(b)
    _models_and_data(b)
    _rest(b)
    return b.out


def _batches(b: _Builder, world: int, kind: str) -> None:
    per_device = _field_int("per_device_train_batch_size", b.get("per_device_train_batch_size"))
    accumulation = _field_int("gradient_accumulation_steps", b.get("gradient_accumulation_steps"))
    k = _field_int("num_generations", b.get("num_generations"), minimum=2)
    step = per_device * accumulation * world  # samples per optimizer step
    gen, spg = b.get("generation_batch_size"), b.get("steps_per_generation")
    micro_steps = _field_int("steps_per_generation", spg) if spg is not None else accumulation
    samples = (_field_int("generation_batch_size", gen) if gen is not None
               else per_device * world * micro_steps)
    if samples % step or samples % k or (spg is not None and samples != per_device * world * micro_steps):
        raise ConfigError(f"TRL fields generation_batch_size / steps_per_generation: a generation batch of "
                          f"{samples} samples must be a whole number of optimizer steps of {step} samples "
                          f"(per_device_train_batch_size x gradient_accumulation_steps x processes) and of "
                          f"num_generations {k}")
    iterations = _field_int("num_iterations", b.get("num_iterations"))
    b.set("num_generations", {"rollout.n_samples_per_prompt": k}, "completions per prompt: a group")
    b.set("per_device_train_batch_size", {"train.micro_batch_size": per_device})
    b.set("gradient_accumulation_steps", {"train.batch_size": step},
          f"an optimizer step = per_device x accumulation x {world} process(es) = {step} samples")
    chosen, other = (("generation_batch_size", "steps_per_generation") if gen is not None else
                     ("steps_per_generation", "generation_batch_size"))
    b.set(chosen, {"rollout.batch_size": samples // k}, f"a generation batch of {samples} samples = "
          f"{samples // k} prompts x num_generations, {samples // step} optimizer step(s)", always=False)
    b.line(other, f"with {chosen}", always=False)
    b.set("num_iterations", {"train.max_epochs": iterations}, "passes over each generation batch")
    steps = _numeric_int(b, "max_steps")
    if steps < 1:
        raise ConfigError("TRL field max_steps is not set: TRL derives the run's length from "
                          "num_train_epochs and the dataset's size, which posttrain does not know before "
                          "loading it; write max_steps: <optimizer steps> in the file")
    per_rollout = samples // step * iterations
    if steps % per_rollout:
        raise ConfigError(f"TRL field max_steps: {steps} is not a multiple of the {per_rollout} optimizer "
                          f"step(s) each generation batch makes (generation batch / optimizer step x "
                          f"num_iterations): posttrain trains whole generation batches; set max_steps to a "
                          f"multiple of {per_rollout}")
    b.set("max_steps", {"train.max_steps": steps // per_rollout},
          f"max_steps / {per_rollout} optimizer step(s) per generation batch = rollouts")
    if "num_train_epochs" in b.given:
        b.line("num_train_epochs", _NO_EFFECT["num_train_epochs"])
    b.set("ds3_gather_for_generation", {"ds.gather_for_generation": bool(b.get("ds3_gather_for_generation"))},
          "read under ZeRO-3 with several actor ranks", always=False)


def _numeric_int(b: _Builder, name: str) -> int:
    return _field_int(name, b.get(name), minimum=-1)


def _clip(b: _Builder) -> None:
    eps = _field_number("epsilon", b.get("epsilon"))
    high = b.get("epsilon_high")
    high = eps if high is None else _field_number("epsilon_high", high)
    b.set("epsilon", {"actor.eps_clip": eps, "actor.eps_clip_low_high": None if high == eps else [eps, high]},
          "ratio clipped to [1 - epsilon, 1 + epsilon_high]")
    b.line("epsilon_high", "with epsilon", always=False)


def _grpo_algorithm(b: _Builder) -> None:
    scale = b.get("scale_rewards")
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale not in ("group", "none"):
        raise ConfigError(f"TRL field scale_rewards: {scale!r} has no posttrain equivalent (posttrain "
                          f"divides by the group's std, not the batch's); use 'group' or 'none'")
    b.set("scale_rewards", {"algo.advantage.estimator": "group_norm" if scale == "group" else "dr_grpo",
                            "reward.clip_range": [-1e9, 1e9]} | ({"algo.advantage.std_eps": 1e-4}
                                                                if scale == "group" else {}),
          "(r - group mean) / (unbiased group std + 1e-4)" if scale == "group" else "r - group mean")
    loss = b.get("loss_type")
    if loss not in _LOSS_AGG:
        raise ConfigError(f"TRL field loss_type: {loss!r} has no posttrain equivalent; use one of "
                          f"{', '.join(_LOSS_AGG)}")
    agg, why = _LOSS_AGG[loss]
    if loss == "bnpo" and b.out.values["train.batch_size"] != b.out.values["train.micro_batch_size"]:
        raise ConfigError("TRL field loss_type: 'bnpo' averages each micro-batch's tokens, posttrain the "
                          "optimizer step's; use 'dapo', or one micro-batch per optimizer step")
    b.set("loss_type", {"actor.loss_agg": agg}, why)
    level = b.get("importance_sampling_level")
    if level not in ("token", "sequence"):
        raise ConfigError(f"TRL field importance_sampling_level: {level!r} must be 'token' or 'sequence'")
    if level == "sequence" and agg == "token_mean":
        raise ConfigError(f"TRL field importance_sampling_level: 'sequence' with loss_type {loss!r} (a token "
                          f"mean) has no posttrain equivalent (posttrain's GSPO weighs sequences alike); use "
                          f"loss_type 'grpo', 'dr_grpo' or 'luspo'")
    b.set("importance_sampling_level", {"actor.policy_loss_type": "ppo" if level == "token" else "gspo"},
          "token ratio" if level == "token" else "GSPO: exp(token mean of the log-ratios) per completion")
    _clip(b)
    delta = b.get("delta")
    high = b.out.values["actor.eps_clip_low_high"] or [0, b.out.values["actor.eps_clip"]]
    if delta is not None and _field_number("delta", delta) <= 1 + high[1]:
        raise ConfigError(f"TRL field delta: {delta} must be > 1 + epsilon_high ({1 + high[1]:g}) for "
                          f"posttrain's dual clip to equal it")
    b.set("delta", {"actor.dual_clip": None if delta is None else _field_number("delta", delta)},
          "caps the unclipped ratio: the dual clip of negative advantages (no effect on positive ones)",
          always=False)
    beta = _field_number("beta", b.get("beta"))
    if beta and b.given.get("use_bias_correction_kl", True):
        raise ConfigError("TRL field use_bias_correction_kl: true (TRL's default) weights the KL loss by the "
                          "importance ratio, which posttrain's KL loss has no equivalent for; set "
                          "use_bias_correction_kl: false, or beta: 0")
    if beta and level == "sequence":
        raise ConfigError(f"TRL field beta: with importance_sampling_level 'sequence' posttrain averages the "
                          f"KL over tokens, TRL by loss_type {loss!r}; use importance_sampling_level 'token' "
                          f"or beta: 0")
    b.set("beta", {"algo.kl.use_loss": bool(beta), "algo.kl.init_coef": beta, "algo.kl.estimator": "k3",
                   "algo.kl.clamp": 0.0},
          "k3 KL to the reference per token, in the loss" if beta else "no KL, no reference model")
    b.line("use_bias_correction_kl", "false: the KL loss unweighted", always=False)
    coef = _field_number("entropy_coef", b.given.get("entropy_coef", 0.0))
    if coef and agg != "token_mean":
        raise ConfigError(f"TRL field entropy_coef: TRL averages the entropy over tokens, posttrain by "
                          f"--actor.loss_agg ({agg} for loss_type {loss!r}); use loss_type 'dapo'")
    if "entropy_coef" in b.given:
        b.set("entropy_coef", {"actor.entropy_coef": coef or None}, "entropy bonus, mean over tokens")


def _rloo_algorithm(b: _Builder) -> None:
    b.out.values.update({"algo.advantage.estimator": "rloo", "actor.policy_loss_type": "seq_sum",
                         "actor.loss_agg": "seq_mean_token_mean", "reward.clip_range": [-1e9, 1e9]})
    beta = _field_number("beta", b.get("beta"))
    b.set("beta", {"algo.kl.init_coef": beta, "algo.kl.estimator": "k1",
                   "algo.kl.sequence_level_enable": True, "algo.kl.use_loss": False, "algo.kl.clamp": 0.0},
          "summed k1 KL of the completion, subtracted from the reward before the baseline")
    normalize = bool(b.get("normalize_advantages"))
    b.set("normalize_advantages", {"algo.advantage.whiten_enable": normalize,
                                   "algo.advantage.whiten_level": "sequence"}
          | ({"algo.advantage.std_eps": 1e-4} if normalize else {}),
          "(A - batch mean) / (unbiased std + 1e-4) over completions")
    _clip(b)
    b.line("loss_type", "not read by RLOOTrainer: exp(summed log-ratio) per completion, clipped, mean over "
                        "completions (--actor.policy_loss_type seq_sum)", always=False)


def _sampling(b: _Builder) -> None:
    b.set("max_completion_length", {"rollout.max_new_tokens": _field_int(
        "max_completion_length", b.get("max_completion_length"))}, "also dr_grpo's normaliser")
    b.set("temperature", {"rollout.temperature": _field_number("temperature", b.get("temperature"))},
          "also divides the training logits")
    b.set("top_p", {"rollout.top_p": _field_number("top_p", b.get("top_p"))}, always=False)
    if b.given.get("use_vllm") and b.given.get("vllm_importance_sampling_correction", True):
        raise ConfigError("TRL field vllm_importance_sampling_correction: true (TRL's default with use_vllm) "
                          "has no posttrain equivalent; set it to false (posttrain's own correction is "
                          "--algo.advantage.is_correction_*)")
    weights = b.given.get("reward_weights")
    if weights is not None:
        b.set("reward_weights",
              {"reward.func_weights": [_field_number("reward_weights", w) for w in weights]})
    b.set("bf16", {"ds.param_dtype": "fp32"}, "bf16 is autocast over the checkpoint's weights and fp32 "
          "optimizer state; posttrain's bf16 keeps no fp32 copy in one process, so fp32 here", always=False)


def _warmup(b: _Builder) -> None:
    """transformers 5's warm-up: `warmup_steps` optimizer steps, or a fraction (< 1) of max_steps
    (`warmup_ratio`, its older name, too); the schedule runs over posttrain's optimizer steps."""
    if _lr_schedule(b, "stepped once per optimizer step, as TRL's Trainer") == "constant":
        return
    steps = _field_number("warmup_steps", b.get("warmup_steps"))
    ratio = _field_number("warmup_ratio", b.given.get("warmup_ratio", 0.0))
    fraction = steps if 0 < steps < 1 else ratio if not steps else 0.0
    warmup = math.ceil(_numeric_int(b, "max_steps") * fraction) if fraction else int(steps)
    b.set("warmup_steps", {"actor.lr_warmup_steps": warmup}, "optimizer steps")
    b.line("warmup_ratio", "with warmup_steps", always=False)


def _models_and_data(b: _Builder) -> None:
    if b.given.get("model_name_or_path") is not None:  # else --actor.model_name_or_path (a config object)
        b.set("model_name_or_path", {"actor.model_name_or_path": b.given["model_name_or_path"]},
              "policy and reference")
    if b.given.get("reward_model_name_or_path"):
        b.set("reward_model_name_or_path",
              {"reward.model_name_or_path": b.given["reward_model_name_or_path"]})
    if "dataset_name" in b.given:
        b.set("dataset_name", {"data.prompt_dataset": b.given["dataset_name"], "data.input_key": "prompt"},
              "the 'prompt' column")
    if b.given.get("dataset_config") is not None:
        raise ConfigError("TRL field dataset_config: posttrain loads a dataset path or name without a config "
                          "name; point dataset_name at the files of that configuration")
    b.set("dataset_train_split", {"data.prompt_split": b.get("dataset_train_split")}, always=False)
    b.set("seed", {"train.seed": _field_int("seed", b.get("seed"), minimum=0)}, always=False)
    for name, flag in (("output_dir", "ckpt.output_dir"), ("logging_steps", "logger.logging_steps"),
                       ("save_steps", "ckpt.save_steps")):
        if name in b.given:
            b.set(name, {flag: b.given[name] if name == "output_dir" else _field_int(name, b.given[name])})
    if "gradient_checkpointing" in b.given:
        b.set("gradient_checkpointing",
              {"actor.gradient_checkpointing_enable": bool(b.given["gradient_checkpointing"])}, "memory only")
    if "deepspeed" in b.given:
        b.set("deepspeed", {"ds.zero_stage": _zero_stage(b.given["deepspeed"])}, "its ZeRO stage")


def _rest(b: _Builder) -> None:
    """Every field not read above: an error when it has no equivalent and changes the training, else a
    line saying why it has no effect; unknown names are errors."""
    known = _known_training_arguments() | set(SCRIPT_FIELDS + MODEL_FIELDS) | set(_REFUSED) | set(_NO_EFFECT)
    problems = []
    for name in [n for n in b.given if n not in b.done]:
        value = b.given[name]
        if name in _REFUSED:
            default, why = _REFUSED[name]
            if value != default:
                problems.append(f"TRL field {name}: {value!r} has no posttrain equivalent ({why}); remove it")
            else:
                b.line(name, f"no effect at TRL's default ({why})")
        elif name in _NO_EFFECT:
            b.line(name, _NO_EFFECT[name])
        elif name.startswith(_PLUMBING) or name in known or name in _SHARED_DEFAULTS:
            b.line(name, "no effect: not read for the update at this setting (logging, saving, engine or "
                         "hub plumbing, or a loss_type / option not in use)")
        else:
            problems.append(f"unknown TRL field {name!r} (not a field of GRPOConfig, RLOOConfig, "
                            f"ScriptArguments or ModelConfig)")
    if problems:
        raise ConfigError.collect(problems, header="TRL config")
