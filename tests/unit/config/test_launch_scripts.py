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


# examples/scripts/train_prorlv2_math_hybrid_engine.sh (REINFORCE++-baseline, ICEPOP, dynamic batching, eval)
PRORL_V2 = r"""
   --ref.num_nodes 1 --ref.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
   --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.75
   --algo.kl.init_coef 1e-4 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2
   --algo.advantage.estimator reinforce_baseline --algo.dynamic_filtering_enable
   --algo.dynamic_filtering_range 0 1
   --actor.eps_clip_low_high 0.2 0.27 --actor.model_name_or_path deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
   --reward.remote_url /w/examples/python/math_reward_func.py --ckpt.output_dir /w/exp/prorl
   --ckpt.path /w/exp/prorl/ckpt --ckpt.save_steps 5 --ckpt.save_hf --train.batch_size 1024
   --rollout.batch_size 512 --rollout.n_samples_per_prompt 16 --train.dynamic_batch_enable
   --train.num_episodes 100 --data.max_len 9216 --rollout.max_new_tokens 8192 --ds.zero_stage 3
   --ds.param_dtype bf16 --actor.adam.lr 1e-6 --data.prompt_dataset OpenRLHF/dapo-math-17k
   --data.input_key prompt --data.label_key label --eval.dataset OpenRLHF/aime-2024 --eval.steps 5
   --eval.temperature 1.0 --eval.n_samples_per_prompt 4 --data.apply_chat_template
   --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager
   --vllm.enable_sleep --ds.enable_sleep --algo.advantage.is_correction_enable
   --algo.advantage.is_correction_threshold 0.5 5.0 --algo.advantage.is_correction_type icepop
   --train.max_tokens_per_gpu 32768 --reward.stop_properly_penalty_coef 0.0
"""

# examples/scripts/train_ppo_with_reward_fn.sh (PPO with a critic, a reward-function file, optimizer offload)
PPO_WITH_REWARD_FN = r"""
   --ref.num_nodes 1 --ref.num_gpus_per_node 2 --critic.num_nodes 1 --critic.num_gpus_per_node 2
   --actor.num_nodes 1 --actor.num_gpus_per_node 2 --vllm.num_engines 2 --vllm.tensor_parallel_size 2
   --train.colocate_actor_ref --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture
   --reward.remote_url /openrlhf/examples/python/reward_func.py
   --ckpt.output_dir /openrlhf/examples/checkpoint/llama3-8b-rlhf --train.micro_batch_size 8
   --train.batch_size 128 --rollout.micro_batch_size 16 --rollout.batch_size 1024 --data.max_samples 100000
   --train.max_epochs 1 --data.max_len 2048 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7
   --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1
   --data.input_key context_messages --data.apply_chat_template --reward.normalize_enable --ds.packing_samples
   --ds.adam_offload --ds.attn_implementation flash_attention_2 --actor.gradient_checkpointing_enable
   --logger.wandb.key WANDB_TOKEN
"""

# examples/scripts/train_sft_mixtral_lora.sh (LoRA SFT of a mixture-of-experts model with the router loss)
SFT_MIXTRAL_LORA = r"""
    --data.max_len 2048 --data.dataset Open-Orca/OpenOrca --data.input_key question --data.output_key response
    --train.batch_size 128 --train.micro_batch_size 4 --data.max_samples 500000
    --model.model_name_or_path mistralai/Mixtral-8x7B-v0.1 --ckpt.output_dir ./checkpoint/mixtral-sft-lora
    --ckpt.save_steps -1 --logger.logging_steps 1 --eval.steps -1 --ds.zero_stage 3 --train.max_epochs 1
    --ds.param_dtype bf16 --model.gradient_checkpointing_enable --ds.attn_implementation flash_attention_2
    --adam.lr 5e-6 --ds.lora.rank 64 --ds.lora.alpha 64 --ds.packing_samples --model.aux_loss_coef 0.001
"""


def test_train_prorlv2_math_script():
    cfg = parse("ppo", PRORL_V2)
    assert cfg.algo.advantage.estimator == "reinforce_baseline" and cfg.algo.advantage.gamma == 1.0
    assert cfg.algo.dynamic_filtering_enable and cfg.algo.dynamic_filtering_range == [0.0, 1.0]
    assert cfg.algo.advantage.is_correction_type == "icepop"
    assert cfg.algo.advantage.is_correction_threshold == [0.5, 5.0]
    # 0.0 is a value (zero reward when truncated), not "off"
    assert cfg.reward.stop_properly_penalty_coef == 0.0
    assert cfg.train.dynamic_batch_enable and cfg.train.max_tokens_per_gpu == 32768
    assert cfg.reward.remote_url.endswith("math_reward_func.py") and cfg.data.label_key == "label"
    assert (cfg.eval.dataset, cfg.eval.steps, cfg.eval.n_samples_per_prompt) == ("OpenRLHF/aime-2024", 5, 4)
    assert cfg.eval.temperature == 1.0 and cfg.train.num_episodes == 100
    assert cfg.ckpt.path == "/w/exp/prorl/ckpt" and cfg.ckpt.save_steps == 5
    assert derived_sizes(cfg, 8)["samples_per_rollout"] == 512 * 16
    inert = "\n".join(inert_flags(cfg, "cpu"))
    assert "--train.dynamic_batch_enable" not in inert and "--algo.advantage.is_correction_type" not in inert


def test_train_ppo_with_reward_fn_script():
    cfg = parse("ppo", PPO_WITH_REWARD_FN)
    assert cfg.reward.remote_url == "/openrlhf/examples/python/reward_func.py"
    assert cfg.critic.num_gpus_per_node == 2 and cfg.critic.adam.lr == 9e-6  # a critic: PPO with GAE
    assert cfg.algo.advantage.estimator == "gae" and cfg.train.colocate_actor_ref
    assert cfg.ds.adam_offload and cfg.ds.zero_stage == 3 and cfg.algo.kl.init_coef == 0.01
    assert (cfg.rollout.batch_size, cfg.train.batch_size, cfg.data.max_samples) == (1024, 128, 100000)


def test_train_sft_mixtral_lora_script():
    cfg = parse("sft", SFT_MIXTRAL_LORA)
    assert cfg.model.model_name_or_path == "mistralai/Mixtral-8x7B-v0.1"
    assert (cfg.ds.lora.rank, cfg.ds.lora.alpha) == (64, 64) and cfg.ds.zero_stage == 3
    assert cfg.model.aux_loss_coef == 0.001 and cfg.ds.packing_samples
    assert derived_sizes(cfg, 8)["gradient_accumulation_steps"] == 128 // (4 * 8)
