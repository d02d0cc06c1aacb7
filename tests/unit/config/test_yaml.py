"""`--config run.yaml`: nested or dotted keys, command-line precedence, round trip of save_config."""

from __future__ import annotations

import pytest
import yaml
from config_args import BASE

from posttrain.config import TRAINERS, ConfigError, config_to_dict, load_config, parse_config, save_config


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_default_round_trip(tmp_path, trainer):
    cfg = parse_config(trainer, BASE[trainer], device="cpu")
    path = save_config(cfg, tmp_path / "config.yaml")
    again = parse_config(trainer, ["--config", str(path)], device="cpu")
    assert again == cfg
    assert yaml.safe_load(path.read_text())["trainer"] == trainer


def test_round_trip_of_changed_values(tmp_path):
    argv = BASE["ppo"] + [
        "--actor.adam.betas",
        "0.8",
        "0.9",
        "--reward.clip_range",
        "-1",
        "2",
        "--actor.eps_clip_low_high",
        "0.1",
        "0.3",
        "--actor.muon.no_nesterov",
        "--data.input_template",
        "Q: {}\nA:",
        "--logger.wandb.key",
        "True",
        "--algo.advantage.estimator",
        "rloo",
        "--rollout.n_samples_per_prompt",
        "4",
        "--ckpt.best_metric_key",
        "none",
        "--critic.value_clip",
        "none",
    ]
    cfg = parse_config("ppo", argv, device="cpu")
    assert cfg.actor.muon.nesterov is False and cfg.critic.value_clip is None
    path = save_config(cfg, tmp_path / "sub" / "config.yaml")
    assert load_config(path) == cfg  # trainer read from the file
    assert config_to_dict(cfg)["ckpt"]["max_mem"] == float("inf")


def test_nested_and_dotted_keys_build_the_same_tree(tmp_path):
    nested = write(tmp_path, "ds:\n  zero_stage: 3\n  lora:\n    rank: 8\nadam:\n  betas: [0.8, 0.9]\n")
    a = parse_config("sft", BASE["sft"] + ["--config", nested], device="cpu")
    dotted = write(tmp_path, "ds.zero_stage: 3\nds.lora.rank: 8\nadam.betas: [0.8, 0.9]\n")
    b = parse_config("sft", BASE["sft"] + [f"--config={dotted}"], device="cpu")
    mixed = write(tmp_path, "ds: {zero_stage: 3, lora.rank: 8}\nadam.betas: [0.8, 0.9]\n")
    c = parse_config("sft", BASE["sft"] + ["--config", mixed], device="cpu")
    assert a == b == c
    assert (a.ds.zero_stage, a.ds.lora.rank, a.adam.betas) == (3, 8, [0.8, 0.9])


def test_command_line_flags_override_the_file(tmp_path):
    path = write(
        tmp_path,
        "train: {micro_batch_size: 4, batch_size: 64}\nadam: {lr: 1e-4}\n"
        "model: {gradient_checkpointing_enable: true}\n",
    )
    cfg = parse_config("sft", BASE["sft"] + ["--config", path, "--train.micro_batch_size", "2"], device="cpu")
    assert cfg.train.micro_batch_size == 2  # flag wins
    assert cfg.train.batch_size == 64 and cfg.adam.lr == 1e-4  # file value ('1e-4' is a YAML string)
    assert cfg.model.gradient_checkpointing_enable is True
    # flags before --config also win
    cfg = parse_config("sft", ["--train.micro_batch_size", "8", "--config", path] + BASE["sft"], device="cpu")
    assert cfg.train.micro_batch_size == 8


def test_yaml_values_are_coerced_and_checked(tmp_path):
    path = write(
        tmp_path,
        "ds.lora.target_modules: all-linear\nmuon.no_nesterov: true\nds.lora.dropout: 0\n"
        "logger.wandb.key: true\n",
    )
    cfg = parse_config("sft", BASE["sft"] + ["--config", path], device="cpu")
    assert cfg.ds.lora.target_modules == ["all-linear"] and cfg.muon.nesterov is False
    assert cfg.ds.lora.dropout == 0.0 and isinstance(cfg.ds.lora.dropout, float)
    assert cfg.logger.wandb.key == "True"


def test_unknown_and_bad_yaml_keys_are_all_reported(tmp_path):
    path = write(
        tmp_path,
        "ds:\n  zero_stge: 3\ntrain_batch_size: 8\noptim: sgd\ntrain:\n  batch_size: many\nds.lora: 3\n",
    )
    with pytest.raises(ConfigError) as err:
        parse_config("sft", BASE["sft"] + ["--config", path])
    msg = str(err.value)
    assert "unknown key 'ds.zero_stge'; did you mean 'ds.zero_stage'?" in msg
    assert "unknown key 'train_batch_size': renamed in OpenRLHF 0.10.2; use 'train.batch_size'" in msg
    assert "'optim': invalid choice 'sgd'; valid values: adam, muon" in msg
    assert "'train.batch_size': expected an integer, got 'many'" in msg
    assert "'ds.lora' is a section: expected a mapping" in msg
    assert len(err.value.problems) == 5


def test_yaml_for_another_trainer_is_rejected(tmp_path):
    cfg = parse_config("dpo", BASE["dpo"], device="cpu")
    path = save_config(cfg, tmp_path / "dpo.yaml")
    with pytest.raises(ConfigError, match="the file is for 'dpo' but this is posttrain sft"):
        parse_config("sft", ["--config", str(path)])


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the file"):
        parse_config("sft", ["--config", str(tmp_path / "nope.yaml")])
    with pytest.raises(ConfigError, match="expected a mapping of flags"):
        parse_config("sft", ["--config", write(tmp_path, "- a\n- b\n")])
    with pytest.raises(ConfigError, match="expected a YAML file path"):
        parse_config("sft", ["--config"])


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    path = write(tmp_path, "train:\n  batch_size: 8\n  max_epochs: 1\n  batch_size: 16\n")
    with pytest.raises(ConfigError, match=r"key 'batch_size' is given twice in one mapping \(line 2 and line "
                                          r"4\)"):
        parse_config("sft", BASE["sft"] + ["--config", path])
    path = write(tmp_path, "optim: adam\noptim: muon\n")
    with pytest.raises(ConfigError, match=r"key 'optim' is given twice .*line 1 and line 2"):
        parse_config("sft", BASE["sft"] + ["--config", path])
