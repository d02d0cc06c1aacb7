"""A TRL-style RLOO YAML (the fields of TRL's examples/scripts/rloo/rloo.py) runs end to end through
`posttrain ppo --config rloo.yaml`: the translation is printed and written into the run directory,
the run lasts TRL's number of rollouts, TRL's missing-EOS penalty and KL reach the rewards, and the
run's config equals the one the posttrain flags of the translation give."""
import json

import pytest
import torch
import yaml

from posttrain.config import parse_config, translate_rloo
from posttrain.config.yaml_io import config_to_dict


@pytest.mark.slow
def test_trl_rloo_yaml_runs_end_to_end(rl_setup, tmp_path, capsys):
    from posttrain.cli import train_ppo_ray

    sft, data, rewards = rl_setup
    out = tmp_path / "run"
    trl = {"dataset_name": str(data), "dataset_train_split": "train", "model_name_or_path": str(sft),
           "sft_model_path": str(sft), "output_dir": str(out), "learning_rate": "2e-3", "rloo_k": 4,
           "num_ppo_epochs": 1, "num_mini_batches": 1, "per_device_train_batch_size": 16,
           "gradient_accumulation_steps": 2, "total_episodes": 96, "response_length": 4, "stop_token": "eos",
           "missing_eos_penalty": 1.0, "kl_coef": 0.01, "temperature": 1.0,
           "local_rollout_forward_batch_size": 16, "seed": 1, "report_to": "none", "whiten_rewards": False,
           "bf16": True}
    path = tmp_path / "rloo.yaml"
    path.write_text(yaml.safe_dump(trl))
    extra = ["--reward.remote_url", str(rewards / "starts_with_1.py"), "--data.label_key", "answer"]
    train_ppo_ray.main(["--config", str(path), *extra])

    log = capsys.readouterr()
    assert "TRL RLOOConfig (v0.21.0 semantics) -> posttrain ppo:" in log.out + log.err
    report = (out / "trl_rloo_translation.txt").read_text()
    for name in trl:
        assert f"\n  {name}: " in report, name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 3  # ceil(96 / (16 x 2 x 1)) rollouts of 8 prompts x 4 samples
    # TRL's missing-EOS penalty of 1: reward = score - 1 for each response cut at the 4-token budget
    assert any(r["response/truncated_frac"] > 0 for r in steps)
    for r in steps:
        assert abs(r["reward/mean"] - (r["score/mean"] - r["response/truncated_frac"])) < 1e-6
        assert "kl/mean" in r
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 3 and saved["rollout"]["batch_size"] == 8
    assert saved["actor"]["policy_loss_type"] == "seq_sum" and saved["actor"]["max_norm"] == 0.0

    # the same config from the translation's posttrain flags
    flags = []
    for key, value in translate_rloo(trl).values.items():
        if isinstance(value, bool):  # the translation's False values are the flags' defaults here
            flags += [f"--{key}"] if value else []
        elif isinstance(value, list):
            flags += [f"--{key}", *map(str, value)]
        elif value is not None:
            flags += [f"--{key}", str(value)]
    direct = config_to_dict(parse_config("ppo", flags + extra, check=False))
    from_file = config_to_dict(parse_config("ppo", ["--config", str(path), *extra], check=False))
    assert direct == from_file

    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(sft).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
