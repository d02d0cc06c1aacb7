"""The run fingerprint (flags that decide the training trajectory) and the checkpoint folder."""
from pathlib import Path

from config_args import BASE

from posttrain.config import (
    adjustable_values,
    checkpoint_dir,
    parse_config,
    resolve_hardware_defaults,
    run_fingerprint,
)
from posttrain.utils.checkpoint import flag_diffs

SFT, PPO = BASE["sft"], BASE["ppo"]


def sft(*extra):
    return parse_config("sft", SFT + list(extra), device="cpu")


def test_trajectory_flags_change_the_digest_and_are_named():
    digest, fields = run_fingerprint(sft())
    other, other_fields = run_fingerprint(sft("--train.seed", "7", "--adam.betas", "0.8", "0.9"))
    assert digest != other and len(digest) == 16
    assert flag_diffs(fields, other_fields) == [
        "--adam.betas: checkpoint 0.9 0.95, this run 0.8 0.9",
        "--train.seed: checkpoint 42, this run 7",
    ]
    assert fields["trainer"] == "sft" and fields["model.model_name_or_path"] == "m"
    assert run_fingerprint(sft("--train.seed", "7", "--adam.betas", "0.8", "0.9"))[0] == other  # stable


def test_volatile_and_adjustable_flags_keep_the_digest():
    digest, fields = run_fingerprint(sft())
    same = sft("--ckpt.output_dir", "elsewhere", "--ckpt.path", "ck", "--ckpt.save_steps", "5",
               "--logger.logging_steps", "3", "--logger.wandb.run_name", "x", "--eval.steps", "2",
               "--eval.dataset", "e.jsonl", "--data.dataloader_num_workers", "2",
               "--train.max_epochs", "5", "--data.max_samples", "10", "--train.micro_batch_size", "4",
               "--ds.packing_samples", "--model.gradient_checkpointing_enable")
    assert run_fingerprint(same)[0] == digest
    assert not any(k.startswith(("ckpt.", "logger.", "eval.")) for k in fields)
    changed = flag_diffs(adjustable_values(sft()), adjustable_values(same))
    assert "--train.max_epochs: checkpoint 2, this run 5" in changed
    assert "--data.max_samples: checkpoint 1000000, this run 10" in changed


def test_values_resolved_for_the_device_count_as_used():
    auto, explicit, gpu = sft(), sft("--ds.param_dtype", "fp32"), sft()
    for cfg in (auto, explicit):
        resolve_hardware_defaults(cfg, "cpu")
    resolve_hardware_defaults(gpu, "cuda")
    assert run_fingerprint(auto) == run_fingerprint(explicit)
    assert flag_diffs(run_fingerprint(gpu)[1], run_fingerprint(auto)[1]) == [
        "--ds.param_dtype: checkpoint bf16, this run fp32"]


def test_ppo_epochs_are_trajectory_and_episodes_are_run_length():
    ppo = parse_config("ppo", PPO, device="cpu")
    _, fields = run_fingerprint(ppo)
    assert "train.max_epochs" in fields and "train.num_episodes" not in fields
    assert "train.num_episodes" in adjustable_values(ppo) and "vllm.num_engines" not in fields


def test_checkpoint_dir_follows_the_output_dir_unless_set():
    assert sft().ckpt.path is None
    assert checkpoint_dir(sft("--ckpt.output_dir", "runs/a")) == Path("runs/a/checkpoints")
    assert checkpoint_dir(sft("--ckpt.path", "/ck")) == Path("/ck")
    assert checkpoint_dir(sft("--ckpt.disable_ds")) is None
    assert checkpoint_dir(sft("--ckpt.path", "")) is None
    assert parse_config("sft", SFT + ["--ckpt.load_enable"], device="cpu").ckpt.load_enable  # no path needed
