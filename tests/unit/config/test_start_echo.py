"""The start-up echo lists only the flags the user set, each with where it came from (command line,
`--config` file, TRL config translation), one screen at most; the warm-up note (issue 48)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.config import config_from_trl_rloo, flag_specs, format_set_flags, parse_config
from posttrain.config.spec import flag_sources
from posttrain.trainers.session import warmup_note


def test_sources_of_command_line_config_file_and_negations(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  batch_size: 8\n  seed: 7\nadam:\n  lr: 0.001\n")
    cfg = parse_config("sft", ["--config", str(config), "--train.batch_size", "16", "--muon.no_nesterov",
                               "--data.max_len=64"], check=False)
    assert flag_sources(cfg) == {
        "data.max_len": "command line", "train.batch_size": "command line",
        "train.seed": f"--config {config}", "adam.lr": f"--config {config}", "muon.nesterov": "command line"}
    text = format_set_flags(cfg, {"world_size": 1}, "out/config.yaml").splitlines()
    assert text[0] == "posttrain sft: 5 flag(s) set:"
    assert "  --train.batch_size 16  (command line)" in text
    assert f"  --train.seed 7  (--config {config})" in text
    assert "  --muon.nesterov False  (command line)" in text
    assert text[-2:] == ["derived sizes: world_size = 1", "every flag's value: out/config.yaml"]
    assert len(text) == 8


def test_a_trl_translation_is_named_as_the_source():
    cfg = config_from_trl_rloo({"rloo_k": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-5,
                                "total_episodes": 64, "sft_model_path": "trl-model"},
                               ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl"],
                               check=False)
    sources = flag_sources(cfg)
    assert sources["rollout.n_samples_per_prompt"] == "TRL config"
    assert sources["actor.adam.lr"] == "TRL config"
    assert sources["actor.model_name_or_path"] == "command line"


def test_the_echo_is_one_screen_and_says_nothing_more_without_flags():
    switches = [f"--{s.path}" for s in flag_specs(type(parse_config("ppo", [], check=False)))
                if s.base is bool and s.default is False and s.negation is None]
    assert len(switches) > 40
    cfg = parse_config("ppo", switches, check=False)
    lines = format_set_flags(cfg).splitlines()
    assert len(lines) <= 42 and lines[-2].startswith("  ... and ") and lines[-1].startswith("every flag's")
    assert format_set_flags(parse_config("sft", [], check=False)).splitlines() == [
        "posttrain sft: 0 flag(s) set, all defaults", "every flag's value: config.yaml"]


def test_a_config_built_in_code_lists_what_differs_from_the_defaults():
    from posttrain.config.trainers import default_config

    cfg = default_config("sft")
    cfg.train.batch_size = 16
    lines = format_set_flags(cfg).splitlines()
    assert lines[:2] == ["posttrain sft: 1 flag(s) set:",
                         "  --train.batch_size 16  (differs from the default)"]


def opt(scheduler="cosine_with_min_lr", ratio=0.03, steps=None):
    return SimpleNamespace(lr_scheduler=scheduler, lr_warmup_ratio=ratio, lr_warmup_steps=steps)


@pytest.mark.parametrize("section, steps, note", [
    (opt(), 3, "lr warm-up covers 1 of the 3 steps (33%, --lr_warmup_ratio 0.03): the first steps log lr "
               "near 0"),
    (opt(), 4, None),  # exactly a quarter
    (opt(), 100, None),
    (opt(ratio=0.3), 10, "lr warm-up covers 3 of the 10 steps (30%, --lr_warmup_ratio 0.3): the first steps "
                         "log lr near 0"),
    (opt(steps=5), 8, "lr warm-up covers 5 of the 8 steps (62%, --lr_warmup_steps 5): the first steps log lr "
                      "near 0"),
    (opt(steps=50), 8, "lr warm-up covers 8 of the 8 steps (100%, --lr_warmup_steps 50): the first steps "
                       "log lr near 0"),
    (opt(scheduler="constant", ratio=0.9), 8, None),
])
def test_warmup_longer_than_a_quarter_of_the_run_is_noted(section, steps, note):
    assert warmup_note(section, steps) == note


def test_the_warmup_note_names_the_role_flag():
    assert "--actor.lr_warmup_steps 2" in warmup_note(opt(steps=2), 4, "actor.")


@pytest.mark.parametrize("command,argv", [
    ("sft", ["--ds.attn_implementation", "flash_attention_2", "--train.seed", "3"]),
    ("chat", ["--model.model_name_or_path", "m", "--model.param_dtype", "bf16"]),
])
def test_sources_and_resolved_values_are_declared_fields_not_hidden_attributes(command, argv):
    """What a parsed config carries besides its flags (where each flag was set, what start-up resolved) is
    a declared field of every command's config: nothing outside `dataclasses.fields` sits on it, a copy
    (`dataclasses.replace`) keeps it, and it is neither a flag, nor YAML, nor compared."""
    import dataclasses

    from posttrain.config import config_to_dict, resolved_values
    from posttrain.config.hardware import record_resolved

    cfg = parse_config(command, argv, check=False)
    path, asked, used = (("ds.attn_implementation", "flash_attention_2", "sdpa") if command == "sft"
                         else ("model.param_dtype", "bf16", "fp32"))
    record_resolved(cfg, path, used, "a CPU run")
    declared = {f.name for f in dataclasses.fields(cfg)}
    assert {"flag_sources", "resolved"} <= declared
    assert set(vars(cfg)) == declared  # no attribute outside the declared fields
    copy = dataclasses.replace(cfg)
    assert flag_sources(copy) == flag_sources(cfg) and flag_sources(cfg)
    assert resolved_values(copy) == resolved_values(cfg) == {
        path: (asked, used, "a CPU run")}
    flags = {s.path.split(".")[0] for s in flag_specs(type(cfg))}
    assert not {"flag_sources", "resolved"} & (flags | set(config_to_dict(cfg)))
    assert copy == type(cfg)(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                                if f.name not in ("flag_sources", "resolved")})
