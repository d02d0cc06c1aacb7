"""TRL 1.x's GRPOConfig and GRPO-based RLOOConfig as a posttrain ppo config: every field of TRL 1.16's two
configs is translated, reported or refused; TRL's batch arithmetic; the loss / advantage / KL settings;
refusals with one line naming the field; detection of the file behind --config; the config objects."""
import json
from pathlib import Path

import pytest
import yaml

from posttrain.compat.trl_grpo import _REFUSED, trl_kind
from posttrain.config import ConfigError, config_from_trl, parse_config, translate_trl, translation_of

FIELDS = Path(__file__).with_name("trl_grpo_config_fields.json")
BASE = {"model_name_or_path": "/models/policy", "max_steps": 4, "num_generations": 4}


def config_fields() -> dict:
    """{"GRPOConfig": {name: default}, "RLOOConfig": {...}}: the fields TRL 1.16 adds to TrainingArguments."""
    data = json.loads(FIELDS.read_text(encoding="utf-8"))
    return {name: data[name] for name in ("GRPOConfig", "RLOOConfig")}


def line_for(translation, name):
    lines = [ln for ln in translation.lines if ln.field == name]
    assert len(lines) == 1, f"{name}: {len(lines)} lines"
    return lines[0]


def test_the_field_list_is_trl_1_16s():
    trl = pytest.importorskip("trl")
    import dataclasses

    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    for name, fields in config_fields().items():
        ours = {f.name for f in dataclasses.fields(getattr(trl, name)) if f.name not in base}
        assert ours == set(fields), (f"TRL {trl.__version__}'s {name} differs from the classified fields: "
                                     f"new {sorted(ours - set(fields))}, gone {sorted(set(fields) - ours)}")


@pytest.mark.parametrize("config", ["GRPOConfig", "RLOOConfig"])
def test_every_field_at_its_default_is_translated_or_reported(config):
    fields = config_fields()[config]
    given = {**fields, **BASE, **({"normalize_advantages": False} if config == "RLOOConfig" else {})}
    t = translate_trl(given)
    assert t.title == f"TRL {config} (v1.16.0 semantics)"
    for name in fields:
        ln = line_for(t, name)
        assert ln.given and ln.effect.strip(), name


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_a_field_without_equivalent_that_changes_training_is_refused(name):
    default = _REFUSED[name][0]
    value = {None: 3, False: True, True: False}.get(default, "other") if default in (None, False, True) else (
        {0: 5, 1.0: 0.5}.get(default, "other"))
    with pytest.raises(ConfigError, match=f"TRL field {name}: .* no posttrain equivalent"):
        translate_trl({**BASE, name: value, **({"normalize_advantages": True} if name == "reward_clip_range"
                                                 else {})})


def test_batches_generation_batch_iterations_and_run_length():
    v = translate_trl({**BASE, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                       "steps_per_generation": 4, "num_iterations": 3, "max_steps": 18}).values
    # a step = 4 x 2 = 8 samples; a generation batch = 4 x 4 = 16 samples = 4 prompts x 4, 2 steps x 3 passes
    assert (v["train.micro_batch_size"], v["train.batch_size"], v["rollout.batch_size"]) == (4, 8, 4)
    assert (v["train.max_epochs"], v["train.max_steps"], v["rollout.n_samples_per_prompt"]) == (3, 3, 4)
    v = translate_trl({**BASE, "per_device_train_batch_size": 4, "generation_batch_size": 12},
                      world_size=3).values
    assert (v["train.batch_size"], v["rollout.batch_size"]) == (12, 3)
    with pytest.raises(ConfigError, match="generation_batch_size"):
        translate_trl({**BASE, "per_device_train_batch_size": 4, "generation_batch_size": 6})
    with pytest.raises(ConfigError, match="TRL field max_steps is not set"):
        translate_trl({"model_name_or_path": "m", "num_generations": 4})
    # TRL stops mid generation batch; posttrain trains whole ones: a max_steps between them is refused
    with pytest.raises(ConfigError, match=r"^TRL field max_steps: 13 is not a multiple of the 6 optimizer"):
        translate_trl({**BASE, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                       "steps_per_generation": 4, "num_iterations": 3, "max_steps": 13})


def test_advantage_loss_and_kl_settings():
    v = translate_trl(BASE).values  # TRL's defaults: group scaling, dapo, token ratio, no KL
    assert (v["algo.advantage.estimator"], v["algo.advantage.std_eps"]) == ("group_norm", 1e-4)
    assert (v["actor.loss_agg"], v["actor.policy_loss_type"], v["algo.kl.use_loss"]) == ("token_mean", "ppo",
                                                                                          False)
    assert translate_trl({**BASE, "scale_rewards": "none"}).values["algo.advantage.estimator"] == "dr_grpo"
    assert translate_trl({**BASE, "scale_rewards": False}).values["algo.advantage.estimator"] == "dr_grpo"
    for loss, agg in (("grpo", "seq_mean_token_mean"), ("dr_grpo", "seq_sum_norm"), ("bnpo", "token_mean"),
                      ("luspo", "seq_mean_token_sum")):
        assert translate_trl({**BASE, "loss_type": loss}).values["actor.loss_agg"] == agg
    v = translate_trl({**BASE, "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4,
                       "delta": 2.0, "loss_type": "grpo"}).values
    assert (v["actor.policy_loss_type"], v["actor.eps_clip_low_high"], v["actor.dual_clip"]) == (
        "gspo", [3e-4, 4e-4], 2.0)
    v = translate_trl({**BASE, "beta": 0.04, "use_bias_correction_kl": False}).values
    assert (v["algo.kl.use_loss"], v["algo.kl.estimator"], v["algo.kl.init_coef"], v["algo.kl.clamp"]) == (
        True, "k3", 0.04, 0.0)
    assert translate_trl({**BASE, "entropy_coef": 0.01}).values["actor.entropy_coef"] == 0.01


@pytest.mark.parametrize("given, match", [
    ({"scale_rewards": "batch"}, "TRL field scale_rewards: 'batch'"),
    ({"loss_type": "cispo"}, "TRL field loss_type: 'cispo'"),
    ({"loss_type": "bnpo", "gradient_accumulation_steps": 2}, "TRL field loss_type: 'bnpo'"),
    ({"beta": 0.04}, "TRL field use_bias_correction_kl"),
    ({"beta": 0.04, "use_bias_correction_kl": False, "importance_sampling_level": "sequence",
      "loss_type": "grpo"}, "TRL field beta"),
    ({"importance_sampling_level": "sequence"},
     "TRL field importance_sampling_level: 'sequence' with loss_type 'dapo'"),
    ({"entropy_coef": 0.01, "loss_type": "grpo"}, "TRL field entropy_coef"),
    ({"delta": 1.1}, "TRL field delta"),
    ({"use_vllm": True}, "TRL field vllm_importance_sampling_correction"),
    ({"num_generation": 4}, "unknown TRL field 'num_generation'"),
])
def test_refusals_name_the_field(given, match):
    with pytest.raises(ConfigError, match=match) as e:
        translate_trl({**BASE, **given})
    assert "\n" not in str(e.value)


def test_rloo_1x():
    t = translate_trl({**BASE, "normalize_advantages": True, "beta": 0.1, "epsilon_high": 0.3})
    v = t.values
    assert t.title.startswith("TRL RLOOConfig (v1.16.0") and t.file == "trl_rloo_translation.txt"
    assert (v["algo.advantage.estimator"], v["actor.policy_loss_type"], v["actor.loss_agg"]) == (
        "rloo", "seq_sum", "seq_mean_token_mean")
    a = "algo.advantage."
    assert (v[a + "whiten_enable"], v[a + "whiten_level"], v[a + "std_eps"]) == (True, "sequence", 1e-4)
    assert (v["algo.kl.estimator"], v["algo.kl.sequence_level_enable"], v["algo.kl.init_coef"]) == (
        "k1", True, 0.1)
    assert translate_trl({**BASE, "reward_clip_range": None}).title.startswith("TRL RLOOConfig")


def test_kind_by_keys_and_by_class():
    assert trl_kind(BASE) == "grpo"
    assert trl_kind({**BASE, "normalize_advantages": False}) == "rloo"
    assert trl_kind({"rloo_k": 2, "learning_rate": 1e-5}) == "rloo<=0.21"
    assert trl_kind({"learning_rate": 1e-5}) == "rloo<=0.21"  # today's reading of a file of shared keys
    with pytest.raises(ConfigError, match="mixed with fields of TRL <= 0.21"):
        trl_kind({**BASE, "rloo_k": 2})
    with pytest.raises(ConfigError, match=r"RLOOConfig only \(normalize_advantages\) mixed with fields of "
                       r"GRPOConfig only \(loss_type\)"):
        trl_kind({**BASE, "normalize_advantages": True, "loss_type": "grpo"})
    # a file of fields both 1.x configs have is read as a GRPOConfig, and the translation says so and how to
    # read it as an RLOOConfig; a GRPOConfig-only field leaves no doubt
    assert "no field that only one of GRPOConfig and RLOOConfig has" in translate_trl(BASE).title
    assert "no field" not in translate_trl({**BASE, "loss_type": "grpo"}).title
    trl = pytest.importorskip("trl")
    grpo = trl.GRPOConfig(output_dir="/tmp/unused", max_steps=2, num_generations=2,
                          per_device_train_batch_size=4, use_cpu=True, bf16=False, loss_type="grpo",
                          report_to="none")
    cfg = config_from_trl(grpo, ["--actor.model_name_or_path", "/models/policy", "--data.prompt_dataset", "d",
                                 "--reward.remote_url", "r.py"], check=False)
    assert (cfg.actor.loss_agg, cfg.rollout.n_samples_per_prompt, cfg.train.batch_size) == (
        "seq_mean_token_mean", 2, 4)
    assert translation_of(cfg).title.startswith("TRL GRPOConfig")
    rloo = trl.RLOOConfig(output_dir="/tmp/unused", max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                          bf16=False, report_to="none")
    assert translate_trl(rloo).values["algo.advantage.estimator"] == "rloo"


def test_yaml_file_through_config_and_flags_on_top(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({**BASE, "dataset_name": "d", "loss_type": "dr_grpo",
                                    "max_completion_length": 16, "learning_rate": "3e-6"}))
    cfg = parse_config("ppo", ["--config", str(path), "--reward.remote_url", "r.py", "--rollout.temperature",
                               "0.5"], check=False)
    assert (cfg.actor.loss_agg, cfg.rollout.max_new_tokens, cfg.actor.adam.lr) == ("seq_sum_norm", 16, 3e-6)
    assert cfg.rollout.temperature == 0.5 and cfg.flag_sources["actor.loss_agg"] == f"TRL config {path}"
    assert translation_of(cfg).file == "trl_grpo_translation.txt"
    path.write_text(yaml.safe_dump({**BASE, "loss_type": "sapo"}))
    with pytest.raises(ConfigError, match=f"--config {path}: TRL field loss_type: 'sapo'"):
        parse_config("ppo", ["--config", str(path)], check=False)


def test_docs_table_names_every_field():
    page = (Path(__file__).parents[3] / "docs" / "from-trl.md").read_text(encoding="utf-8")
    section = page[page.index("## TRL 1.x: GRPOConfig and RLOOConfig"):]
    missing = [name for fields in config_fields().values() for name in fields if f"`{name}`" not in section]
    assert not missing, f"docs/from-trl.md's GRPOConfig / RLOOConfig table does not name {missing}"


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_the_example_files_translate(kind):
    path = Path(__file__).parents[3] / "examples" / "trl" / f"{kind}.yaml"
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert trl_kind(data) == kind
    v = translate_trl(data).values
    assert (v["rollout.batch_size"], v["train.batch_size"], v["train.max_steps"]) == (8, 32, 4)
    assert v["algo.advantage.estimator"] == ("group_norm" if kind == "grpo" else "rloo")


def test_the_grpo_only_fields_are_trls():
    from posttrain.compat.trl_grpo import _GRPO_ONLY, _RLOO_ONLY

    fields = config_fields()
    assert _GRPO_ONLY == set(fields["GRPOConfig"]) - set(fields["RLOOConfig"])
    assert _RLOO_ONLY == set(fields["RLOOConfig"]) - set(fields["GRPOConfig"])
