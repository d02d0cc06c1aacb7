"""Launch commands in the style of OpenRLHF 0.10.2's examples/scripts parse to the expected values (only
the module name would change)."""

from __future__ import annotations

import shlex

import pytest

from posttrain.config import ConfigWarning, checkpoint_dir, derived_sizes, inert_flags, parse_config

SFT = r"""
   --data.max_len 4096 \
   --data.dataset Open-Orca/OpenOrca \
   --data.input_key question \
   --data.output_key response \
   --data.input_template $'User: {}\nAssistant: ' \
   --train.batch_size 256 \
   --train.micro_batch_size 2 \
   --data.max_samples 500000 \
   --model.model_name_or_path meta-llama/Meta-Llama-3-8B \
   --ckpt.output_dir ./checkpoint/llama3-8b-sft \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --ds.zero_stage 2 \
   --train.max_epochs 1 \
   --ds.packing_samples \
   --ds.param_dtype bf16 \
   --adam.lr 5e-6 \
   --model.gradient_checkpointing_enable \
   --ds.attn_implementation flash_attention_2 \
   --logger.wandb.key WANDB_TOKEN
"""

RM = r"""
   --ckpt.output_dir ./checkpoint/llama3-8b-rm \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --train.batch_size 256 \
   --train.micro_batch_size 1 \
   --model.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --ds.param_dtype bf16 \
   --train.max_epochs 1 \
   --data.max_len 8192 \
   --ds.zero_stage 3 \
   --adam.lr 9e-6 \
   --data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku \
   --data.apply_chat_template \
   --data.chosen_key chosen \
   --data.rejected_key rejected \
   --ds.attn_implementation flash_attention_2 \
   --ds.packing_samples \
   --model.gradient_checkpointing_enable \
   --ds.value_head_prefix value_head \
   --logger.wandb.key WANDB_TOKEN
"""

DPO = r"""
   --ckpt.output_dir ./checkpoint/llama3-8b-dpo \
   --ckpt.save_steps -1 \
   --logger.logging_steps 1 \
   --eval.steps -1 \
   --train.batch_size 256 \
   --train.micro_batch_size 1 \
   --model.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --ds.param_dtype bf16 \
   --train.max_epochs 1 \
   --data.max_len 8192 \
   --ds.zero_stage 3 \
   --adam.lr 5e-7 \
   --model.beta 0.1 \
   --data.dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku \
   --data.apply_chat_template \
   --data.chosen_key chosen \
   --data.rejected_key rejected \
   --ds.attn_implementation flash_attention_2 \
   --ds.packing_samples \
   --model.gradient_checkpointing_enable \
   --ref.offload \
   --ds.lora.rank 16 --ds.lora.alpha 32 --ds.lora.target_modules q_proj v_proj
"""

PPO_REINFORCE_BASELINE = r"""
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 8 \
   --reward.num_nodes 1 \
   --reward.num_gpus_per_node 8 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 8 \
   --vllm.num_engines 4 \
   --vllm.tensor_parallel_size 2 \
   --train.colocate_all \
   --vllm.gpu_memory_utilization 0.5 \
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture \
   --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k \
   --ckpt.output_dir /openrlhf/examples/test_scripts/final/llama3-8b-rlhf \
   --ckpt.path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf \
   --ckpt.save_hf \
   --ckpt.max_num 2 \
   --ckpt.save_steps 20 \
   --train.micro_batch_size 8 \
   --train.batch_size 128 \
   --rollout.micro_batch_size 16 \
   --rollout.batch_size 128 \
   --rollout.n_samples_per_prompt 8 \
   --train.max_epochs 1 \
   --data.max_len 2048 \
   --rollout.max_new_tokens 1024 \
   --data.max_samples 100000 \
   --ds.param_dtype bf16 \
   --ds.zero_stage 3 \
   --actor.adam.lr 5e-7 \
   --algo.kl.init_coef 1e-4 \
   --algo.advantage.estimator reinforce_baseline \
   --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 \
   --data.input_key context_messages \
   --data.apply_chat_template \
   --reward.normalize_enable \
   --actor.gradient_checkpointing_enable \
   --ds.packing_samples \
   --vllm.sync_backend nccl \
   --vllm.enforce_eager \
   --vllm.enable_sleep \
   --ds.enable_sleep \
   --algo.kl.use_loss \
   --algo.kl.estimator k2 \
   --actor.eps_clip_low_high 0.2 0.28 \
   --algo.advantage.is_correction_enable \
   --algo.advantage.is_correction_threshold 0.5 5.0 \
   --reward.clip_range -10 10 \
   --logger.wandb.key WANDB_TOKEN
"""


def tokens(script: str) -> list[str]:
    """Split like bash: $'..' strings become their escaped text, backslash-newlines vanish."""
    script = script.replace("\\\n", " ")
    script = script.replace("$'User: {}\\nAssistant: '", "'User: {}\nAssistant: '")
    return shlex.split(script)


def parse(trainer: str, script: str):
    with pytest.warns(ConfigWarning, match="140x slower"):  # bf16 on this CPU-only machine
        return parse_config(trainer, tokens(script), device="cpu", world_size=1)


def test_train_sft_script():
    cfg = parse("sft", SFT)
    assert cfg.trainer == "sft"
    assert cfg.data.max_len == 4096 and cfg.data.dataset == "Open-Orca/OpenOrca"
    assert (cfg.data.input_key, cfg.data.output_key) == ("question", "response")
    assert cfg.data.input_template == "User: {}\nAssistant: "
    assert (cfg.train.batch_size, cfg.train.micro_batch_size, cfg.train.max_epochs) == (256, 2, 1)
    assert cfg.data.max_samples == 500000
    assert cfg.model.model_name_or_path == "meta-llama/Meta-Llama-3-8B"
    assert cfg.ckpt.output_dir == "./checkpoint/llama3-8b-sft" and cfg.ckpt.save_steps == -1
    assert cfg.logger.logging_steps == 1 and cfg.eval.steps == -1
    assert cfg.ds.zero_stage == 2 and cfg.ds.packing_samples and cfg.ds.param_dtype == "bf16"
    assert cfg.adam.lr == 5e-6 and cfg.model.gradient_checkpointing_enable
    assert cfg.logger.wandb.key == "WANDB_TOKEN"
    # untouched flags keep the SFT defaults of OpenRLHF 0.10.2, except --ckpt.path: unset, it follows
    # --ckpt.output_dir (OpenRLHF: ./ckpt/checkpoints_sft, shared by every run started from one folder)
    assert cfg.ckpt.path is None and cfg.eval.split == "train"
    assert str(checkpoint_dir(cfg)) == "checkpoint/llama3-8b-sft/checkpoints"
    assert cfg.adam.betas == [0.9, 0.95] and cfg.lr_scheduler == "cosine_with_min_lr"
    assert (cfg.lr_warmup_ratio, cfg.min_lr_ratio, cfg.max_norm) == (0.03, 0.1, 1.0)
    assert derived_sizes(cfg, 8)["gradient_accumulation_steps"] == 256 // (2 * 8)


def test_train_rm_script():
    cfg = parse("rm", RM)
    assert cfg.model.model_name_or_path == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert (cfg.train.batch_size, cfg.train.micro_batch_size) == (256, 1)
    assert cfg.data.max_len == 8192 and cfg.ds.zero_stage == 3 and cfg.adam.lr == 9e-6
    assert cfg.data.apply_chat_template and (cfg.data.chosen_key, cfg.data.rejected_key) == (
        "chosen",
        "rejected",
    )
    assert cfg.ds.attn_implementation == "flash_attention_2" and cfg.ds.value_head_prefix == "value_head"
    assert cfg.model.loss_type == "sigmoid" and cfg.ckpt.path is None


def test_train_dpo_script():
    cfg = parse("dpo", DPO)
    assert cfg.adam.lr == 5e-7 and cfg.model.beta == 0.1 and cfg.ref.offload
    assert cfg.ds.lora.rank == 16 and cfg.ds.lora.alpha == 32
    assert cfg.ds.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.eval.split == "test" and cfg.ckpt.path is None
    assert cfg.model.ipo_enable is False and cfg.model.label_smoothing == 0.0


def test_train_ppo_ray_reinforce_baseline_script():
    cfg = parse("ppo", PPO_REINFORCE_BASELINE)
    assert cfg.algo.advantage.estimator == "reinforce_baseline"
    assert (cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.micro_batch_size) == (
        128,
        8,
        16,
    )
    assert (cfg.train.batch_size, cfg.train.micro_batch_size) == (128, 8)
    assert cfg.rollout.max_new_tokens == 1024 and cfg.data.max_len == 2048
    assert cfg.actor.adam.lr == 5e-7 and cfg.critic.adam.lr == 9e-6
    assert cfg.algo.kl.init_coef == 1e-4 and cfg.algo.kl.use_loss and cfg.algo.kl.estimator == "k2"
    assert cfg.data.prompt_dataset == "OpenRLHF/prompt-collection-v0.1"
    assert cfg.data.input_key == "context_messages" and cfg.reward.normalize_enable
    assert cfg.vllm.num_engines == 4 and cfg.vllm.gpu_memory_utilization == 0.5 and cfg.train.colocate_all
    assert cfg.actor.eps_clip_low_high == [0.2, 0.28] and cfg.actor.clip_bounds() == (0.2, 0.28)
    assert cfg.algo.advantage.is_correction_threshold == [0.5, 5.0]
    assert cfg.reward.clip_range == [-10.0, 10.0]
    assert cfg.ckpt.max_num == 2 and cfg.ckpt.save_hf and cfg.ckpt.max_mem == float("inf")
    sizes = derived_sizes(cfg, 8)
    assert sizes["samples_per_rollout"] == 1024 and sizes["optimizer_steps_per_rollout"] == 8
    assert sizes["gradient_accumulation_steps"] == 128 // (8 * 8)
    # on this CPU machine the placement flags act (Ray, CPU ranks); vLLM-only flags are reported inert
    inert = "\n".join(inert_flags(cfg, "cpu"))
    assert "--vllm.gpu_memory_utilization 0.5 has no effect here" in inert
    assert "--vllm.num_engines" not in inert and "--train.colocate_all" not in inert
    assert "--ds.enable_sleep" in inert
