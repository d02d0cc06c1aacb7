"""The "nothing silent" contract for flags: every flag of every trainer command either acts, is
covered by an inert rule (`hardware.inert_rules`, reported once at start-up when set), or is refused
by validation when set.

`ACTING[trainer]` lists the flags whose value the code of that trainer reads (outside the config
layer). A flag may be both acting and covered by a conditional rule (e.g. `--ref.offload` acts on a
GPU and is reported as inert on a CPU); a flag whose rule always applies must not be listed as acting.
`REFUSED[trainer]` lists flags that validation rejects whenever they are set (features this version
does not have and whose silent absence would change the results). The tests in
tests/config/test_flag_coverage.py enforce that the three sets cover every flag of each trainer and that
each acting flag's attribute is read somewhere in posttrain/ outside posttrain/config.
"""

from __future__ import annotations

from posttrain.config.hardware import inert_rules
from posttrain.config.spec import flag_specs
from posttrain.config.trainers import config_class, default_config


def _paths(*groups: str) -> frozenset[str]:
    """Dotted paths from groups written 'prefix: name name ...' (or bare space-separated paths)."""
    out = set()
    for group in groups:
        prefix, _, names = group.rpartition(":")
        for name in names.split():
            out.add(f"{prefix.strip()}.{name}" if prefix else name)
    return frozenset(out)


_OPTIMIZER = ("optim", "lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm")
_ADAM_MUON = (
    "adam.lr",
    "adam.betas",
    "adam.eps",
    "adam.weight_decay",
    "muon.lr",
    "muon.momentum",
    "muon.ns_steps",
    "muon.nesterov",
)


def _optimizer(prefix: str = "") -> frozenset[str]:
    return frozenset(prefix + name for name in _OPTIMIZER + _ADAM_MUON)


_SHARED = _paths(
    "ds: param_dtype attn_implementation packing_samples onednn_linear",
    "data: max_len max_samples input_template apply_chat_template tokenizer_chat_template disable_fast_tokenizer",
    "train: batch_size micro_batch_size max_epochs seed dynamic_batch_enable max_tokens_per_gpu",
    "eval: dataset split steps",
    "ckpt: output_dir path save_steps save_hf disable_ds max_num max_mem load_enable",
    "logger: logging_steps tensorboard_dir",
    "logger.wandb: key org group project run_name",
)

# the single-model trainers: session.SingleModelRun (engine, loop, export) + their objectives
_SINGLE_MODEL = (
    _SHARED
    | _optimizer()
    | _paths(
        "model: model_name_or_path gradient_checkpointing_enable gradient_checkpointing_reentrant",
        "ds: zero_stage zpg adam_offload overlap_comm grad_accum_dtype load_in_4bit",
        "ds.lora: rank alpha dropout target_modules",
        "data: dataset dataset_probs dataset_split",
    )
)

ACTING: dict[str, frozenset[str]] = {
    "sft": _SINGLE_MODEL | _paths("model: pretrain_mode_enable", "data: input_key output_key multiturn"),
    "rm": _SINGLE_MODEL
    | _paths(
        "model: loss_type margin_loss_enable",
        "ds: value_head_prefix",
        "data: prompt_key chosen_key rejected_key",
    ),
    "dpo": _SINGLE_MODEL
    | _paths(
        "model: beta ipo_enable label_smoothing nll_loss_coef",
        "ref: model_name_or_path offload",
        "data: prompt_key chosen_key rejected_key",
    ),
    # trainers/rl/ppo.py and what it builds (roles, updates, collect, reward sources)
    "ppo": _SHARED
    | _optimizer("actor.")
    | _optimizer("critic.")
    | _paths(
        "actor: model_name_or_path gradient_checkpointing_enable gradient_checkpointing_reentrant",
        "actor: eps_clip eps_clip_low_high dual_clip policy_loss_type entropy_coef loss_agg",
        "critic: model_name_or_path value_clip save_value_network freezing_steps",
        "ref: model_name_or_path offload",
        "reward: model_name_or_path remote_url normalize_enable clip_range overlong_buffer_len",
        "reward: overlong_penalty_factor stop_properly_penalty_coef whiten_enable skip_errors_enable",
        "reward: timeout retries missing_eos_penalty batch_normalize_enable batch_normalize_clip",
        "algo.advantage: estimator gamma lambd no_std_norm whiten_enable whiten_level is_correction_enable",
        "algo.advantage: is_correction_type is_correction_threshold",
        "algo.kl: init_coef target horizon estimator use_loss sequence_level_enable clamp",
        "algo: dynamic_filtering_enable dynamic_filtering_range",
        "ds: value_head_prefix shared_prefix gather_for_generation",
        "rollout: batch_size micro_batch_size n_samples_per_prompt temperature top_p max_new_tokens",
        "rollout: max_tokens_per_gpu stop_token_ids",
        "data: prompt_dataset prompt_probs prompt_split input_key label_key",
        "train: num_episodes max_steps enable_ema ema_beta",
        "eval: temperature n_samples_per_prompt",
        "ckpt: best_metric_key",
        # the Ray placement (config/ray_mode.py, distributed/)
        "actor: num_nodes num_gpus_per_node",
        "critic: num_nodes num_gpus_per_node",
        "ref: num_nodes num_gpus_per_node",
        "reward: num_nodes num_gpus_per_node",
        "vllm: num_engines sync_backend sync_with_ray tensor_parallel_size",
        # the vLLM engine (a Ray worker on a CUDA node with vLLM installed; trainers/rl/placement/workers.py)
        "vllm: gpu_memory_utilization enforce_eager enable_prefix_caching",
        "train: colocate_actor_ref colocate_critic_reward colocate_all",
        # multi-turn agents (agents/multi_turn.py)
        "train: agent_func_path",
        "agent: timeout max_failure_frac",
        "ds: zero_stage zpg adam_offload overlap_comm grad_accum_dtype",
        # async RL (trainers/rl/async_pipeline.py)
        "train: async_enable async_queue_size partial_rollout_enable",
        "rollout: vllm_generate_batch_size",
    ),
}

REFUSED: dict[str, frozenset[str]] = {
    "sft": frozenset(),
    "rm": frozenset(),
    "dpo": frozenset(),
    "ppo": frozenset(),
}


def flag_coverage(trainer: str) -> dict[str, set[str]]:
    """path -> the ways it is covered for `trainer`: a subset of {"acting", "inert", "always-inert",
    "refused"} ("always-inert": a rule without a condition covers it). An empty set breaks the contract."""
    cfg = default_config(trainer)
    out: dict[str, set[str]] = {s.path: set() for s in flag_specs(config_class(trainer))}
    for path in ACTING[trainer]:
        out.setdefault(path, set()).add("acting")
    for path in REFUSED[trainer]:
        out.setdefault(path, set()).add("refused")
    for rule in inert_rules(cfg):
        kinds = out.setdefault(rule.path, set())
        kinds.add("inert")
        if rule.when is None:
            kinds.add("always-inert")
    return out


def contract_problems(trainer: str) -> list[str]:
    """Every way `trainer`'s flags break the contract (empty when it holds): a flag neither acting,
    inert-ruled nor refused; a registry or rule entry that is not a flag of the trainer; a flag listed
    as acting that a rule always reports as inert."""
    flags = {s.path for s in flag_specs(config_class(trainer))}
    problems = []
    for path, kinds in flag_coverage(trainer).items():
        if path not in flags:
            problems.append(f"{trainer}: {path} is named by the registry or a rule but is not a flag")
        elif not kinds:
            problems.append(f"{trainer}: --{path} is neither acting, inert-ruled nor refused")
        elif {"acting", "always-inert"} <= kinds:
            problems.append(f"{trainer}: --{path} is listed as acting but a rule always reports it as inert")
    return problems


__all__ = ["ACTING", "REFUSED", "contract_problems", "flag_coverage"]
