"""Explanations for flags a trainer does not know: flat flags of OpenRLHF before 0.10.2 (with the dotted
flag that replaced them; for `chat` / `generate` / `eval` also the flags of OpenRLHF 0.9's
`batch_inference` and `interactive_chat`), flags that were removed, flags that belong to another trainer,
and typos (closest known flag by difflib)."""

from __future__ import annotations

import difflib

# Old flat flag -> new dotted flag(s). A dict picks by trainer: "ppo" or "single" (SFT / RM / DPO).
_ROLE = {"ppo": "--actor.{0}", "single": "--model.{0}"}
_OPT = {"ppo": "--actor.{0} / --critic.{0}", "single": "--{0}"}

RENAMED: dict[str, str | dict[str, str]] = {
    # models
    "--pretrain": {k: v.format("model_name_or_path") for k, v in _ROLE.items()},
    "--reward_pretrain": "--reward.model_name_or_path",
    "--ref_pretrain": "--ref.model_name_or_path",
    "--critic_pretrain": "--critic.model_name_or_path",
    "--remote_rm_url": "--reward.remote_url",
    "--attn_implementation": "--ds.attn_implementation",
    "--flash_attn": "--ds.attn_implementation flash_attention_2",
    "--bf16": "--ds.param_dtype bf16",
    "--use_liger_kernel": "--ds.use_liger_kernel",
    "--load_in_4bit": "--ds.load_in_4bit",
    "--gradient_checkpointing": {k: v.format("gradient_checkpointing_enable") for k, v in _ROLE.items()},
    "--gradient_checkpointing_use_reentrant": {
        k: v.format("gradient_checkpointing_reentrant") for k, v in _ROLE.items()
    },
    "--freeze_visual_encoder": "--actor.freeze_visual_encoder",
    "--lora_rank": "--ds.lora.rank",
    "--lora_alpha": "--ds.lora.alpha",
    "--lora_dropout": "--ds.lora.dropout",
    "--target_modules": "--ds.lora.target_modules",
    # placement / colocation
    **{f"--{r}_num_nodes": f"--{r}.num_nodes" for r in ("actor", "critic", "ref", "reward")},
    **{f"--{r}_num_gpus_per_node": f"--{r}.num_gpus_per_node" for r in ("actor", "critic", "ref", "reward")},
    "--colocate_actor_ref": "--train.colocate_actor_ref",
    "--colocate_critic_reward": "--train.colocate_critic_reward",
    "--colocate_all_models": "--train.colocate_all",
    # vLLM / DeepSpeed
    "--enforce_eager": "--vllm.enforce_eager",
    "--enable_prefix_caching": "--vllm.enable_prefix_caching",
    "--deepspeed_enable_sleep": "--ds.enable_sleep",
    **{
        f"--{n}": f"--ds.{n}"
        for n in (
            "zero_stage",
            "param_dtype",
            "adam_offload",
            "zpg",
            "overlap_comm",
            "grad_accum_dtype",
            "deepcompile",
            "use_universal_ckpt",
            "ring_attn_size",
            "packing_samples",
            "value_head_prefix",
        )
    },
    "--ring_head_stride": "--ds.ring_attn_head_stride",
    # rollout / data / train / eval / ckpt / logger
    "--temperature": "--rollout.temperature",
    "--top_p": "--rollout.top_p",
    "--max_new_tokens": "--rollout.max_new_tokens",
    "--rollout_batch_size": "--rollout.batch_size",
    "--micro_rollout_batch_size": "--rollout.micro_batch_size",
    "--n_samples_per_prompt": "--rollout.n_samples_per_prompt",
    "--vllm_generate_batch_size": "--rollout.vllm_generate_batch_size",
    "--rollout_max_tokens_per_gpu": "--rollout.max_tokens_per_gpu",
    "--prompt_data": "--data.prompt_dataset",
    "--data.prompt": "--data.prompt_dataset",
    "--prompt_data_probs": "--data.prompt_probs",
    "--prompt_split": "--data.prompt_split",
    **{
        f"--{n}": f"--data.{n}"
        for n in (
            "dataset",
            "dataset_probs",
            "dataset_split",
            "input_key",
            "output_key",
            "label_key",
            "image_key",
            "prompt_key",
            "chosen_key",
            "rejected_key",
            "input_template",
            "apply_chat_template",
            "tokenizer_chat_template",
            "max_len",
            "max_samples",
            "multiturn",
            "max_images_per_prompt",
            "dataloader_num_workers",
            "disable_fast_tokenizer",
        )
    },
    "--train_batch_size": "--train.batch_size",
    "--micro_train_batch_size": "--train.micro_batch_size",
    "--train_max_tokens_per_gpu": "--train.max_tokens_per_gpu",
    "--max_epochs": "--train.max_epochs",
    "--num_episodes": "--train.num_episodes",
    "--seed": "--train.seed",
    "--full_determinism": "--train.full_determinism_enable",
    "--async_train": "--train.async_enable",
    "--async_queue_size": "--train.async_queue_size",
    "--partial_rollout": "--train.partial_rollout_enable",
    "--use_dynamic_batch": "--train.dynamic_batch_enable",
    "--enable_ema": "--train.enable_ema",
    "--ema_beta": "--train.ema_beta",
    "--agent_func_path": "--train.agent_func_path",
    "--eval_dataset": "--eval.dataset",
    "--eval_split": "--eval.split",
    "--eval_steps": "--eval.steps",
    "--eval_temperature": "--eval.temperature",
    "--eval_n_samples_per_prompt": "--eval.n_samples_per_prompt",
    "--save_path": "--ckpt.output_dir",
    "--ckpt_path": "--ckpt.path",
    "--save_steps": "--ckpt.save_steps",
    "--save_hf_ckpt": "--ckpt.save_hf",
    "--disable_ds_ckpt": "--ckpt.disable_ds",
    "--max_ckpt_num": "--ckpt.max_num",
    "--max_ckpt_mem": "--ckpt.max_mem",
    "--load_checkpoint": "--ckpt.load_enable",
    "--best_metric_key": "--ckpt.best_metric_key",
    "--use_wandb": "--logger.wandb.key",
    "--wandb_org": "--logger.wandb.org",
    "--wandb_group": "--logger.wandb.group",
    "--wandb_project": "--logger.wandb.project",
    "--wandb_run_name": "--logger.wandb.run_name",
    "--use_tensorboard": "--logger.tensorboard_dir",
    "--logging_steps": "--logger.logging_steps",
    # RL algorithm / loss
    "--advantage_estimator": "--algo.advantage.estimator",
    "--gamma": "--algo.advantage.gamma",
    "--lambd": "--algo.advantage.lambd",
    "--no_advantage_std_norm": "--algo.advantage.no_std_norm",
    "--enable_vllm_is_correction": "--algo.advantage.is_correction_enable",
    "--vllm_is_correction_type": "--algo.advantage.is_correction_type",
    "--vllm_is_truncated_threshold": "--algo.advantage.is_correction_threshold",
    "--init_kl_coef": "--algo.kl.init_coef",
    "--kl_target": "--algo.kl.target",
    "--kl_horizon": "--algo.kl.horizon",
    "--kl_estimator": "--algo.kl.estimator",
    "--use_kl_loss": "--algo.kl.use_loss",
    "--dynamic_filtering": "--algo.dynamic_filtering_enable",
    "--dynamic_filtering_reward_range": "--algo.dynamic_filtering_range",
    "--eps_clip": "--actor.eps_clip",
    "--eps_clip_low_high": "--actor.eps_clip_low_high",
    "--dual_clip": "--actor.dual_clip",
    "--policy_loss_type": "--actor.policy_loss_type",
    "--entropy_loss_coef": "--actor.entropy_coef",
    "--aux_loss_coef": {k: v.format("aux_loss_coef") for k, v in _ROLE.items()},
    "--freezing_actor_steps": "--critic.freezing_steps",
    "--value_clip": "--critic.value_clip",
    "--save_value_network": "--critic.save_value_network",
    "--ref_offload": "--ref.offload",
    "--ref_reward_offload": "--reward.offload",
    "--normalize_reward": "--reward.normalize_enable",
    "--reward_clip_range": "--reward.clip_range",
    "--overlong_buffer_len": "--reward.overlong_buffer_len",
    "--overlong_penalty_factor": "--reward.overlong_penalty_factor",
    "--stop_properly_penalty_coef": "--reward.stop_properly_penalty_coef",
    # optimizer / scheduler
    "--learning_rate": {"ppo": "--actor.adam.lr", "single": "--adam.lr"},
    "--actor_learning_rate": "--actor.adam.lr",
    "--critic_learning_rate": "--critic.adam.lr",
    "--adam_betas": {k: v.format("adam.betas") for k, v in _OPT.items()},
    "--adam_eps": {k: v.format("adam.eps") for k, v in _OPT.items()},
    "--l2": {k: v.format("adam.weight_decay") for k, v in _OPT.items()},
    "--muon_lr": {k: v.format("muon.lr") for k, v in _OPT.items()},
    "--muon_momentum": {k: v.format("muon.momentum") for k, v in _OPT.items()},
    "--muon_ns_steps": {k: v.format("muon.ns_steps") for k, v in _OPT.items()},
    "--muon_nesterov": {k: v.format("muon.nesterov") for k, v in _OPT.items()},
    "--no_muon_nesterov": {k: v.format("muon.no_nesterov") for k, v in _OPT.items()},
    # model-level loss knobs (single-model trainers)
    "--beta": "--model.beta",
    "--ipo": "--model.ipo_enable",
    "--label_smoothing": "--model.label_smoothing",
    "--nll_loss_coef": "--model.nll_loss_coef",
    "--compute_fp32_loss": "--model.compute_fp32_loss_enable",
    "--margin_loss": "--model.margin_loss_enable",
    "--pretrain_mode": "--model.pretrain_mode_enable",
    "--loss": "--model.loss_type",
    # OpenRLHF 0.9's train_kto (the command was removed in 0.9.6)
    "--desirable_loss_weight": "--model.desirable_weight",
    "--undesirable_loss_weight": "--model.undesirable_weight",
}

# OpenRLHF 0.9.0-0.9.5's batch_inference / interactive_chat flags -> posttrain chat / generate / eval's
# (those not here fall back to RENAMED, read as a single-model trainer's: --max_len -> --data.max_len, ...).
BATCH_INFERENCE_RENAMED: dict[str, str] = {
    "--pretrain": "--model.model_name_or_path",
    "--dataset": "--data.dataset",
    "--best_of_n": "--rollout.n_samples_per_prompt",
    "--greedy_sampling": "--rollout.temperature 0",
    "--output_path": "--output",
    "--bf16": "--model.param_dtype bf16",
    "--param_dtype": "--model.param_dtype",
    "--eval_task": "--rollout.engine hf|vllm (generate -> hf, generate_vllm -> vllm; rm: score the samples "
                   "with generate --reward.model_name_or_path)",
}
_BATCH_INFERENCE, _RENAMED = "OpenRLHF 0.9's batch_inference flag", "renamed in OpenRLHF 0.10.2"
# OpenRLHF 0.9's train_kd (gone in 0.10.2): its own flags; the rest are train_sft's, renamed as above
TRAIN_KD_RENAMED = {"--teacher_model": "--teacher.model_name_or_path",
                    "--teacher_offload": "--teacher.offload", "--kd_coef": "--model.kd_coef"}
_TRAIN_KD = "OpenRLHF 0.9's train_kd flag"
# OpenRLHF 0.9's train_prm (gone in 0.10.2): its own flags (--input_key / --label_key: RENAMED's)
TRAIN_PRM_RENAMED = {"--placeholder_token": "--model.placeholder_token",
                     "--reward_tokens": "--model.reward_tokens"}
_TRAIN_PRM = "OpenRLHF 0.9's train_prm flag"

# OpenRLHF's flat `--vllm_X` / `--ds_X` flags became `--vllm.X` / `--ds.X` (those not in RENAMED: the rule is
# only a guess, taken when the dotted flag exists).
SECTION_PREFIXES = {"--vllm_": "--vllm.", "--ds_": "--ds."}

REMOVED: dict[str, str] = {
    "--muon_adam_lr": "the auxiliary Adam group of Muon uses --adam.lr (PPO: --actor.adam.lr)",
    "--actor_init_on_gpu": "the legacy init-on-GPU path is gone",
    "--ptx_coef": "PPO-ptx was never wired up",
    "--actor.ptx_coef": "PPO-ptx was never wired up",
    "--train.perf_tracking_enable": "it had no implementation",
    "--train_split": "it duplicated --data.dataset_split",
}

# Flags whose counterpart in the other trainer family has a different name.
_CROSS = {
    "ppo": {
        "--data.dataset": "--data.prompt_dataset",
        "--data.dataset_probs": "--data.prompt_probs",
        "--data.dataset_split": "--data.prompt_split",
    },
    "serve": {},
    "infer": {},
    "single": {
        "--data.prompt_dataset": "--data.dataset",
        "--data.prompt_probs": "--data.dataset_probs",
        "--data.prompt_split": "--data.dataset_split",
    },
}

_FLAT_OPTIM_ROOTS = ("optim", "adam", "muon", "lr_scheduler", "lr_warmup_ratio", "lr_warmup_steps",
                     "min_lr_ratio", "max_norm")


def _family(trainer: str) -> str:
    """"ppo", "single" (sft / rm / dpo), "serve" (serve-rm, whose renamed flags are PPO's) or "infer" (chat,
    generate, eval: OpenRLHF 0.9's batch_inference names first, then a single-model trainer's)."""
    return {"ppo": "ppo", "serve-rm": "serve", "chat": "infer", "generate": "infer", "eval": "infer"}.get(
        trainer, "single")


def renamed(old: str, trainer: str) -> tuple[str | None, str]:
    """(the flag(s) replacing OpenRLHF's old flag `old` for `trainer`, or None; where the old name is from:
    "renamed in OpenRLHF 0.10.2", OpenRLHF 0.9's batch_inference, its train_kd or its train_prm)."""
    family = _family(trainer)
    if family == "infer" and old in BATCH_INFERENCE_RENAMED:
        return BATCH_INFERENCE_RENAMED[old], _BATCH_INFERENCE
    if old in TRAIN_KD_RENAMED:
        return TRAIN_KD_RENAMED[old], _TRAIN_KD
    if old in TRAIN_PRM_RENAMED:
        return TRAIN_PRM_RENAMED[old], _TRAIN_PRM
    new = RENAMED.get(old) or _by_section_prefix(old)
    if isinstance(new, dict):
        new = new["ppo" if family in ("ppo", "serve") else "single"]
    return new, _RENAMED


def _by_section_prefix(old: str) -> str | None:
    """`--vllm.X` for `--vllm_X`, `--ds.X` for `--ds_X` (SECTION_PREFIXES), else None."""
    return next((new + old[len(flat):] for flat, new in SECTION_PREFIXES.items() if old.startswith(flat)),
                None)


def renamed_to(old: str, trainer: str) -> str | None:
    """The flag(s) replacing OpenRLHF's old flag `old` for `trainer` (`renamed`), or None."""
    return renamed(old, trainer)[0]


def explain_unknown(flag: str, trainer: str, known: set[str], owners: dict[str, list[str]]) -> str:
    """One sentence explaining why `flag` is not accepted by `trainer` and what to use instead.

    known: every flag of `trainer`; owners: flag -> trainers that have it (all trainers)."""
    prog = f"posttrain {trainer}"
    if flag in REMOVED:
        return f"unknown flag {flag}: removed in OpenRLHF 0.10.2 ({REMOVED[flag]})"
    family = _family(trainer)
    new, why = renamed(flag, trainer)
    guessed = why == _RENAMED and flag not in RENAMED  # by SECTION_PREFIXES: only when the dotted flag exists
    if new is not None and not (guessed and new not in known and new not in owners):
        first = new.split()[0]
        if first in known:
            return f"unknown flag {flag}: {why}; use {new}"
        cross = _CROSS[family].get(first)
        if cross:
            return f"unknown flag {flag}: {why}; {prog} uses {cross}"
        where = ("posttrain " + ", ".join(owners[first])) if owners.get(first) else "no posttrain trainer"
        to = " to" if why == _RENAMED else "; posttrain's is"
        return f"unknown flag {flag}: {why}{to} {new}, a flag of {where}, not of {prog}"
    cross = _CROSS[family].get(flag)
    if cross:
        return f"unknown flag {flag}: {prog} reads this from {cross}"
    name = flag[2:]
    root = name.split(".")[0]
    if family == "ppo" and root in _FLAT_OPTIM_ROOTS:
        return (f"unknown flag {flag}: {prog} sets the optimizer per model; use --actor.{name} (and "
                f"--critic.{name})")
    if family == "ppo" and root == "model" and f"--actor.{name[6:]}" in known:
        return f"unknown flag {flag}: {prog} configures the policy under --actor.*; use --actor.{name[6:]}"
    if family == "single" and root == "actor":
        rest = name[6:]
        for cand in (f"--model.{rest}", f"--{rest}"):
            if cand in known:
                return f"unknown flag {flag}: {prog} has one model; use {cand}"
    if flag in owners:
        msg = f"unknown flag {flag}: it is a flag of posttrain {', '.join(owners[flag])}, not of {prog}"
    else:
        msg = f"unknown flag {flag}"
    close = difflib.get_close_matches(flag, sorted(known), n=1, cutoff=0.75)
    if close:
        return f"{msg}; did you mean {close[0]}?"
    return msg if flag in owners else f"{msg} (see {prog} --help)"
