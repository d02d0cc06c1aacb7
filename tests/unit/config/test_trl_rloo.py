"""A TRL RLOOConfig (v0.14-v0.21) as a posttrain ppo config: every field of the seed's RLOOConfig is
translated or noted, TRL's batch-size arithmetic, refusals with one clear line, detection of TRL
files behind --config, the Python API on a dict and on a dataclass object."""
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.compat.trl_rloo import MODEL_FIELDS, ON_POLICY_FIELDS, RLOO_FIELDS, SCRIPT_FIELDS
from posttrain.config import ConfigError, config_from_trl_rloo, parse_config, translate_rloo, translation_of

SEED = Path(__file__).with_name("trl_rloo_config_fields.json")
BASE = {"sft_model_path": "/models/sft", "total_episodes": 64}


def seed_fields() -> dict:
    """name -> default of every field of TRL's RLOOConfig (extracted once from its source)."""
    return json.loads(SEED.read_text(encoding="utf-8"))["fields"]


def line_for(translation, name):
    lines = [ln for ln in translation.lines if ln.field == name]
    assert len(lines) == 1, f"{name}: {len(lines)} lines"
    return lines[0]


def test_every_field_of_the_seed_rloo_config_is_translated_or_noted():
    fields = seed_fields()
    assert set(fields) == set(RLOO_FIELDS), ("the seed's RLOOConfig and trl_rloo.RLOO_FIELDS must list the "
                                             "same fields")
    given = {**BASE, **fields, "reward_model_path": "/models/rm"}
    t = translate_rloo(given)
    for name in fields:
        ln = line_for(t, name)
        assert ln.given and ln.effect.strip(), name
    assert "--train.max_epochs 4" in line_for(t, "num_ppo_epochs").effect
    for name in ("whiten_rewards", "token_level_kl", "exp_name"):
        assert line_for(t, name).effect.startswith("no effect: "), name


@pytest.mark.parametrize("name", ON_POLICY_FIELDS + SCRIPT_FIELDS + MODEL_FIELDS)
def test_every_on_policy_script_and_model_field_is_translated_noted_or_refused(name):
    values = {"stop_token": "eos", "stop_token_id": 7, "logging_steps": 3, "bf16": True, "push_to_hub": False,
              "dataset_config": "default", "lora_target_modules": ["q_proj"], "torch_dtype": "bfloat16"}
    given = {**BASE, name: values.get(name, 1 if "size" in name or "num" in name or "steps" in name else "x")}
    if name in ("stop_token_id",):
        given["stop_token"] = None
    try:
        t = translate_rloo(given)
    except ConfigError as e:
        assert name in str(e)
        return
    assert line_for(t, name).effect.strip()


def test_trl_batch_arithmetic_with_two_processes():
    t = translate_rloo({**BASE, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                        "num_mini_batches": 2, "rloo_k": 4, "total_episodes": 1000,
                        "local_rollout_forward_batch_size": 16}, world_size=2)
    v = t.values
    # local_batch = 4*2*2 = 16 per process, 32 samples = 8 prompts x 4; 2 mini-batches of 16;
    # ceil(1000/32) = 32
    assert v["rollout.batch_size"] == 8 and v["rollout.n_samples_per_prompt"] == 4
    assert v["train.batch_size"] == 16 and v["train.micro_batch_size"] == 4
    assert v["train.max_steps"] == 32 and v["rollout.micro_batch_size"] == 16
    assert v["algo.advantage.estimator"] == "rloo" and v["actor.policy_loss_type"] == "seq_sum"


def test_trl_defaults_fill_what_the_file_leaves_out():
    t = translate_rloo(BASE)
    v = t.values
    assert (v["rollout.n_samples_per_prompt"] == 2 and v["algo.kl.init_coef"] == 0.05
            and v["actor.eps_clip"] == 0.2)
    assert (v["train.max_epochs"] == 4 and v["rollout.temperature"] == 0.7
            and v["rollout.max_new_tokens"] == 53)
    assert v["actor.adam.lr"] == 5e-5 and v["actor.adam.betas"] == [0.9, 0.999] and v["actor.max_norm"] == 0.0
    assert v["actor.lr_scheduler"] == "linear" and v["actor.lr_warmup_steps"] == 0
    assert v["rollout.batch_size"] == 4 and v["train.batch_size"] == 8 and v["train.max_steps"] == 8
    assert v["rollout.stop_token_ids"] == []  # TRL without stop_token generates past EOS
    assert v["algo.kl.sequence_level_enable"] is True and v["reward.clip_range"][1] >= 1e9
    assert not line_for(t, "kl_coef").given and "(TRL default)" in t.report()


@pytest.mark.parametrize("given, expected", [
    ({"stop_token": "eos"}, None),
    ({"stop_token_id": 5}, [5]),
    ({}, []),
])
def test_stop_token(given, expected):
    assert translate_rloo({**BASE, **given}).values["rollout.stop_token_ids"] == expected


def test_schedule_and_warmup_as_transformers_get_scheduler():
    # BASE: 8 rollouts, num_ppo_epochs 4 x num_mini_batches 1 = 4 optimizer steps per rollout
    v = translate_rloo({**BASE, "lr_scheduler_type": "cosine", "warmup_steps": 2}).values
    assert v["actor.lr_scheduler"] == "cosine" and "actor.min_lr_ratio" not in v
    assert v["actor.lr_warmup_steps"] == 2 * 4 and "actor.lr_warmup_ratio" not in v
    v = translate_rloo({**BASE, "lr_scheduler_type": "cosine_with_min_lr",
                        "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}).values
    assert v["actor.lr_scheduler"] == "cosine_with_min_lr" and v["actor.min_lr_ratio"] == 0.1
    v = translate_rloo({**BASE, "lr_scheduler_type": "cosine_warmup_with_min_lr", "learning_rate": 1e-4,
                        "lr_scheduler_kwargs": {"min_lr": 1e-5}}).values
    assert (v["actor.lr_scheduler"] == "cosine_warmup_with_min_lr"
            and v["actor.min_lr_ratio"] == pytest.approx(0.1))
    t = translate_rloo({**BASE, "lr_scheduler_type": "constant", "warmup_ratio": 0.3})
    assert t.values["actor.lr_scheduler"] == "constant" and "actor.lr_warmup_steps" not in t.values
    assert "no warm-up" in line_for(t, "warmup_ratio").effect  # transformers' constant schedule has none
    for name in ("linear", "cosine_with_restarts", "polynomial", "constant_with_warmup", "inverse_sqrt"):
        assert translate_rloo({**BASE, "lr_scheduler_type": name}).values["actor.lr_scheduler"] == name
    # kwargs at transformers' defaults are the same schedule; others are refused
    assert translate_rloo({**BASE, "lr_scheduler_type": "polynomial",
                           "lr_scheduler_kwargs": {"power": 1.0, "lr_end": 1e-7}}
                          ).values["actor.lr_scheduler"]
    with pytest.raises(ConfigError,
                       match=r"\['power'\] have no posttrain equivalent for polynomial.*power: 1.0"):
        translate_rloo({**BASE, "lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2.0}})
    # warmup_ratio: TrainingArguments' ceil(rollouts x ratio) rollouts: ceil(8 x 0.15) = 2 rollouts = 8 steps
    assert translate_rloo({**BASE, "warmup_ratio": 0.15}).values["actor.lr_warmup_steps"] == 8


def test_trl_warmup_steps_is_carried_as_an_exact_count():
    """TRL's warmup_steps counts scheduler steps (one per rollout). It used to travel as the ratio
    warmup_steps / rollouts, which ceil(total x ratio) rounds up one step too far for 590 pairs
    (7 / 25 x 25 = 7.000000000000001 -> 8). Now the translation carries the count of optimizer steps:
    exactly warmup_steps x the optimizer steps of one rollout, which the schedule uses as given."""
    from posttrain.engines.schedulers import lr_multiplier, schedule_of

    shifted = 0
    for rollouts in range(1, 61):
        for warmup in range(1, rollouts + 1):
            v = translate_rloo({**BASE, "num_ppo_epochs": 1, "per_device_train_batch_size": 2,
                                "total_episodes": 2 * rollouts, "warmup_steps": warmup}).values
            assert (v["train.max_steps"] == rollouts
                    and v["actor.lr_warmup_steps"] == warmup), (rollouts, warmup)
            f = lr_multiplier("constant_with_warmup", total_steps=rollouts,
                              warmup_steps=v["actor.lr_warmup_steps"])
            assert f(warmup) == 1.0 and f(warmup - 1) == (warmup - 1) / warmup  # TRL's end of warm-up
            old_count = math.ceil(rollouts * (warmup / rollouts))  # what the ratio gave
            shifted += old_count != warmup
    assert shifted == 32 and math.ceil(25 * (7 / 25)) == 8  # pairs (rollouts <= 60) the ratio moved one step
    # 4 optimizer steps per rollout (num_ppo_epochs 2 x num_mini_batches 2): the warm-up ends at the first
    # update of rollout `warmup_steps`, as in TRL
    cfg = config_from_trl_rloo({**BASE, "num_ppo_epochs": 2, "num_mini_batches": 2, "total_episodes": 16 * 25,
                                "warmup_steps": 7}, check=False)
    assert cfg.train.max_steps == 25 and cfg.actor.lr_warmup_steps == 28
    f = schedule_of(cfg.actor, total_steps=25 * 4)
    assert f(27) == 27 / 28 and f(28) == 1.0 and f(29) == (100 - 29) / (100 - 28)


def test_clipping_precision_and_step_ratios():
    v = translate_rloo(BASE).values
    # fp32 weights, bf16 only autocast in TRL
    assert v["actor.max_norm"] == 0.0 and v["ds.param_dtype"] == "fp32"
    stage3 = {"zero_optimization": {"stage": 3}}
    v = translate_rloo({**BASE, "deepspeed": stage3}).values
    assert v["actor.max_norm"] == 1.0 and v["ds.zero_stage"] == 3  # DeepSpeed clips at max_grad_norm ('auto')
    v = translate_rloo({**BASE, "deepspeed": stage3, "max_grad_norm": 0.5}).values
    assert v["actor.max_norm"] == 0.5
    # 0.5 of TRL's state.max_steps = 8 rollouts x 1 mini-batch // 2 = 4 -> 2
    v = translate_rloo({**BASE, "save_steps": 0.5, "logging_steps": 0.25}).values
    assert v["ckpt.save_steps"] == 2 and v["logger.logging_steps"] == 1


@pytest.mark.parametrize("given, words", [
    ({"rloo_k": 3}, "multiple of rloo_k 3"),
    ({"stop_token": "</s>"}, "must be 'eos'"),
    ({"stop_token": "eos", "stop_token_id": 2}, "mutually exclusive"),
    ({"kl_cof": 0.1}, "did you mean 'kl_coef'"),
    ({"total_episodes": None}, "total_episodes is not set"),
    ({"optim": "sgd"}, "adamw_torch"),
    ({"optim": "adamw_bnb_8bit"}, "no posttrain equivalent"),
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "needs lr_scheduler_kwargs"),
    ({"lr_scheduler_kwargs": {"power": 2.0}}, "['power']"),
    ({"lr_scheduler_type": "warmup_stable_decay"}, "lr_scheduler_type"),
    ({"lr_scheduler_type": "cosine_warmup_with_min_lr"}, "needs lr_scheduler_kwargs"),
    ({"dataset_config": "plain_text"}, "dataset_config"),
    ({"sft_model_path": None}, "sft_model_path and model_name_or_path"),
    ({"rloo_k": 1}, "rloo_k: 1 must be an integer >= 2"),
    ({"kl_coef": "much"}, "kl_coef: 'much' must be a number"),
])
def test_refusals_name_the_field(given, words):
    fields = {k: v for k, v in {**BASE, **given}.items() if v is not None}
    with pytest.raises(ConfigError, match=None) as e:
        translate_rloo(fields)
    assert words in str(e.value)


def write(path, data):
    path.write_text(yaml.safe_dump(data) if path.suffix == ".yaml" else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_config_file_detected_translated_and_overridden_by_flags(tmp_path, suffix):
    path = write(tmp_path / f"rloo{suffix}", {**BASE, "rloo_k": 4, "per_device_train_batch_size": 8,
                                              "learning_rate": 3e-6, "missing_eos_penalty": 1.0,
                                              "stop_token": "eos"})
    cfg = parse_config("ppo",
                       ["--config", path, "--reward.remote_url", "r.py", "--rollout.temperature", "1.0"],
                       check=False)
    assert cfg.rollout.n_samples_per_prompt == 4 and cfg.rollout.batch_size == 2 and cfg.train.batch_size == 8
    assert cfg.actor.adam.lr == 3e-6 and cfg.reward.missing_eos_penalty == 1.0
    assert cfg.rollout.temperature == 1.0  # the command line wins over the file
    assert translation_of(cfg) is not None and "rloo_k: 4" in translation_of(cfg).report()
    assert translation_of(parse_config("ppo", ["--reward.remote_url", "r.py"], check=False)) is None


def test_translated_config_validates(tmp_path):
    cfg = config_from_trl_rloo({**BASE, "normalize_advantage": True, "normalize_reward": True,
                                "dataset_name": "d"},
                               ["--reward.remote_url", "r.py"])
    assert cfg.algo.advantage.whiten_enable and cfg.algo.advantage.whiten_level == "sequence"
    assert cfg.reward.batch_normalize_enable and cfg.actor.loss_agg == "seq_mean_token_mean"


def test_trl_file_mixed_with_posttrain_keys_is_refused(tmp_path):
    path = write(tmp_path / "rloo.yaml", {**BASE, "actor": {"eps_clip": 0.1}, "ds.zero_stage": 2})
    with pytest.raises(ConfigError, match=r"mixed with posttrain keys \(actor, ds.zero_stage\)"):
        parse_config("ppo", ["--config", path], check=False)


def test_trl_file_for_another_trainer_is_refused(tmp_path):
    path = write(tmp_path / "rloo.yaml", BASE)
    with pytest.raises(ConfigError, match="is for posttrain ppo, not posttrain sft"):
        parse_config("sft", ["--config", path], check=False)


def test_python_api_takes_a_dataclass_object():
    @dataclasses.dataclass
    class RLOOConfig:  # the shape of trl.RLOOConfig: only fields that differ from the defaults count as given
        rloo_k: int = 2
        kl_coef: float = 0.05
        sft_model_path: str = "EleutherAI/pythia-160m"
        total_episodes: int | None = None

    cfg = config_from_trl_rloo(RLOOConfig(rloo_k=4, sft_model_path="/models/sft", total_episodes=16),
                               ["--reward.remote_url", "r.py"], check=False)
    assert cfg.rollout.n_samples_per_prompt == 4 and cfg.train.max_steps == 2  # ceil(16 / (8 x 1 x 1))
    assert not line_for(translation_of(cfg), "kl_coef").given

    @dataclasses.dataclass
    class GRPOStyleRLOOConfig:  # TRL 0.22+
        num_generations: int = 2

    with pytest.raises(ConfigError, match="no rloo_k"):
        translate_rloo(GRPOStyleRLOOConfig())


def test_cli_refuses_a_bad_trl_file_with_one_line_and_exit_2(tmp_path):
    path = write(tmp_path / "rloo.yaml", {**BASE, "rloo_k": 3})
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "ppo", "--config", path],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "multiple of rloo_k 3" in lines[0] and "Traceback" not in proc.stderr
