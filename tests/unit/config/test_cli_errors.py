"""Command-line errors name the flag and what is valid; --help lists every flag by section."""

from __future__ import annotations

import pytest

from posttrain.config import (
    TRAINERS,
    ConfigError,
    build_parser,
    config_class,
    flag_specs,
    main_error_exit,
    parse_config,
)


def error(trainer: str, *argv: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(trainer, list(argv), check=False)
    assert isinstance(err.value, ValueError)
    return str(err.value)


def test_unknown_flag_suggests_the_closest():
    assert error("sft", "--train.micro_batchsize", "4") == (
        "unknown flag --train.micro_batchsize; did you mean --train.micro_batch_size?"
    )
    assert "did you mean --actor.adam.lr?" in error("ppo", "--actor.adam.lrr", "1e-6")
    assert error("sft", "--totally_unrelated").endswith("(see posttrain sft --help)")


def test_no_prefix_abbreviation():
    assert "did you mean --train.micro_batch_size?" in error("sft", "--train.micro_batch", "4")


def test_old_flags_name_the_new_dotted_flag():
    msg = error(
        "sft",
        "--pretrain",
        "m",
        "--train_batch_size",
        "8",
        "--save_path",
        "out",
        "--learning_rate",
        "1e-5",
        "--zero_stage",
        "3",
        "--use_wandb",
        "tok",
    )
    assert "unknown flags (6 problems)" in msg
    assert "--pretrain: renamed in OpenRLHF 0.10.2; use --model.model_name_or_path" in msg
    assert "--train_batch_size: renamed in OpenRLHF 0.10.2; use --train.batch_size" in msg
    assert "--save_path: renamed in OpenRLHF 0.10.2; use --ckpt.output_dir" in msg
    assert "--learning_rate: renamed in OpenRLHF 0.10.2; use --adam.lr" in msg
    assert "--zero_stage: renamed in OpenRLHF 0.10.2; use --ds.zero_stage" in msg
    assert "--use_wandb: renamed in OpenRLHF 0.10.2; use --logger.wandb.key" in msg

    # the same old flag maps per trainer family
    assert "use --actor.model_name_or_path" in error("ppo", "--pretrain", "m")
    assert "use --actor.adam.lr" in error("ppo", "--learning_rate", "1e-6")
    assert "posttrain ppo uses --data.prompt_dataset" in error("ppo", "--dataset", "d")


def test_flat_vllm_and_ds_flags_map_to_their_section_by_rule():
    """OpenRLHF's flat `--vllm_X` / `--ds_X` became `--vllm.X` / `--ds.X`: named by rule when that flag exists
    (in this trainer or another), never for a field no trainer has."""
    assert error("ppo", "--vllm_tensor_parallel_size", "2").endswith(
        "renamed in OpenRLHF 0.10.2; use --vllm.tensor_parallel_size")
    assert error("ppo", "--vllm_enable_sleep").endswith("use --vllm.enable_sleep")
    assert error("sft", "--ds_tensor_parallel_size", "2").endswith("use --ds.tensor_parallel_size")
    assert "--vllm.num_engines, a flag of posttrain" in error("sft", "--vllm_num_engines", "2")
    assert "renamed" not in error("ppo", "--vllm_no_such_field", "1")
    assert "use --rollout.vllm_generate_batch_size" in error("ppo", "--vllm_generate_batch_size", "8")


def test_openrlhf_09_batch_inference_flags_name_posttrains():
    """An OpenRLHF 0.9 `batch_inference` command line (best-of-n sampling) given to `posttrain generate`:
    each flag's hint names posttrain's flag; the 0.10.2 renames still apply where 0.9 used the old name."""
    msg = error("generate", "--eval_task", "generate_vllm", "--pretrain", "m", "--dataset", "d.jsonl",
                "--best_of_n", "4", "--greedy_sampling", "--max_new_tokens", "64", "--output_path", "o.jsonl",
                "--bf16")
    assert "unknown flags (8 problems)" in msg
    batch = "OpenRLHF 0.9's batch_inference flag; use"
    for old, new in [("--eval_task", "--rollout.engine"), ("--pretrain", "--model.model_name_or_path"),
                     ("--dataset", "--data.dataset"), ("--best_of_n", "--rollout.n_samples_per_prompt"),
                     ("--greedy_sampling", "--rollout.temperature 0"), ("--output_path", "--output"),
                     ("--bf16", "--model.param_dtype bf16")]:
        assert f"{old}: {batch} {new}" in msg
    assert "--max_new_tokens: renamed in OpenRLHF 0.10.2; use --rollout.max_new_tokens" in msg
    assert error("eval", "--best_of_n", "4") == \
        f"unknown flag --best_of_n: {batch} --rollout.n_samples_per_prompt"
    assert "--best_of_n (see posttrain ppo --help)" in error("ppo", "--best_of_n", "4")  # not a ppo name


def test_flags_of_the_other_trainer_family_point_to_the_right_one():
    assert "use --actor.adam.lr (and --critic.adam.lr)" in error("ppo", "--adam.lr", "1e-6")
    assert "reads this from --data.prompt_dataset" in error("ppo", "--data.dataset", "d")
    assert "reads this from --data.dataset" in error("sft", "--data.prompt_dataset", "d")
    assert "use --model.model_name_or_path" in error("dpo", "--actor.model_name_or_path", "m")
    assert "it is a flag of posttrain sft, kd, not of posttrain rm" in error("rm", "--data.multiturn")


def test_invalid_choice_lists_the_valid_values():
    assert error("sft", "--optim", "sgd") == "--optim: invalid choice 'sgd'; valid values: adam, muon"
    assert error("ppo", "--algo.advantage.estimator", "a2c") == (
        "--algo.advantage.estimator: invalid choice 'a2c'; valid values: "
        "gae, reinforce, reinforce_baseline, rloo, group_norm, dr_grpo"
    )
    assert error("sft", "--ds.param_dtype", "fp8") == (
        "--ds.param_dtype: invalid choice 'fp8'; valid values: bf16, fp16, fp32, None"
    )


@pytest.mark.parametrize("name, ours", [
    ("grpo", "group_norm"), ("GRPO", "group_norm"), ("RLOO", "rloo"), ("reinforce++", "reinforce"),
    ("reinforce_plus_plus", "reinforce"), ("reinforce++-baseline", "reinforce_baseline"),
    ("reinforce++_baseline", "reinforce_baseline"), ("dr-grpo", "dr_grpo"), ("drgrpo", "dr_grpo"),
    ("Dr_GRPO", "dr_grpo"), ("ppo", "gae"),
])
def test_an_estimator_name_from_trl_verl_or_openrlhf_names_ours(name, ours):
    """The names other frameworks give an estimator are refused with the one posttrain uses (issue 48)."""
    assert error("ppo", "--algo.advantage.estimator", name) == (
        f"--algo.advantage.estimator: invalid choice {name!r}; {name} is called {ours} here "
        f"(--algo.advantage.estimator {ours}); valid values: gae, reinforce, reinforce_baseline, rloo, "
        "group_norm, dr_grpo")


def test_wrong_types_name_the_flag():
    assert error("sft", "--ds.zero_stage", "two") == "--ds.zero_stage: expected an integer, got 'two'"
    assert error("sft", "--adam.lr", "fast") == "--adam.lr: expected a number, got 'fast'"
    assert error("sft", "--adam.betas", "0.9") == "--adam.betas: expected 2 arguments"
    assert "--ds.zero_stage: expected one argument" in error("sft", "--ds.zero_stage")
    assert "--ckpt.load_enable: ignored explicit argument 'yes'" in error("sft", "--ckpt.load_enable=yes")
    assert "unexpected value '0.99'" in error("sft", "--adam.betas", "0.9", "0.95", "0.99")


def test_value_forms():
    cfg = parse_config(
        "sft",
        [
            "--data.max_samples",
            "1e6",
            "--adam.lr=3e-5",
            "--data.input_template=Q: {} A:",
            "--ds.lora.target_modules",
            "all-linear",
            "--eval.steps",
            "-1",
        ],
        check=False,
    )
    assert cfg.data.max_samples == 1000000 and isinstance(cfg.data.max_samples, int)
    assert cfg.adam.lr == 3e-5 and cfg.data.input_template == "Q: {} A:"
    assert cfg.ds.lora.target_modules == ["all-linear"] and cfg.eval.steps == -1
    cfg = parse_config(
        "ppo",
        [
            "--reward.clip_range",
            "-5",
            "5",
            "--algo.dynamic_filtering_range",
            "0",
            "1",
            "--reward.stop_properly_penalty_coef",
            "-0.5",
            "--rollout.max_new_tokens",
            "None",
            "--muon.no_nesterov",
        ][:-1]
        + ["--actor.muon.no_nesterov"],
        check=False,
    )
    assert cfg.reward.clip_range == [-5.0, 5.0] and cfg.algo.dynamic_filtering_range == [0.0, 1.0]
    assert cfg.reward.stop_properly_penalty_coef == -0.5 and cfg.rollout.max_new_tokens is None
    assert cfg.actor.muon.nesterov is False and cfg.critic.muon.nesterov is True
    cfg = parse_config("sft", ["--muon.no_nesterov", "--muon.nesterov"], check=False)
    assert cfg.muon.nesterov is True  # last one wins, like argparse


def test_unknown_trainer():
    with pytest.raises(ConfigError, match="unknown trainer 'nope'; valid: sft, rm, dpo, ppo, kd, kto, prm"):
        parse_config("nope", [])


@pytest.mark.parametrize("trainer", TRAINERS)
def test_help_lists_every_flag_grouped_by_section(trainer, capsys):
    with pytest.raises(SystemExit) as done:
        parse_config(trainer, ["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for spec in flag_specs(config_class(trainer)):
        assert spec.flag in out, spec.flag
    assert "\nds.lora:\n" in out and "\nlogger.wandb:\n" in out and "\ntop-level flags:\n" in out
    assert "--config RUN.YAML" in out
    help_text = " ".join(build_parser(trainer).format_help().split())
    assert "unset: <--ckpt.output_dir>/checkpoints" in help_text


def test_help_shows_per_trainer_defaults():
    assert "--adam.lr FLOAT learning rate (default: 9e-06)" in " ".join(
        build_parser("rm").format_help().split()
    )
    dpo = " ".join(build_parser("dpo").format_help().split())
    assert "evaluation split (default: test)" in dpo


def test_main_error_exit(capsys):
    with pytest.raises(SystemExit) as done:
        main_error_exit(ConfigError("--optim: invalid choice 'sgd'; valid values: adam, muon"))
    assert done.value.code == 2
    assert (
        capsys.readouterr().err
        == "posttrain: error: --optim: invalid choice 'sgd'; valid values: adam, muon\n"
    )


def test_negative_numbers_are_values():
    cfg = parse_config(
        "sft",
        ["--adam.lr", "-1e-3", "--adam.betas", "-.5", "-2", "--min_lr_ratio", "-1E+2", "--eval.steps", "-1"],
        check=False,
    )
    assert cfg.adam.lr == -1e-3 and cfg.adam.betas == [-0.5, -2.0] and cfg.min_lr_ratio == -100.0
    assert cfg.eval.steps == -1
    cfg = parse_config(
        "ppo",
        ["--reward.clip_range", "-1e-3", "5", "--reward.stop_properly_penalty_coef", "-.5"],
        check=False,
    )
    assert cfg.reward.clip_range == [-1e-3, 5.0] and cfg.reward.stop_properly_penalty_coef == -0.5
    assert error("sft", "--ds.zero_stage", "-1e-3") == "--ds.zero_stage: expected an integer, got '-1e-3'"
    assert "--adam.lr: expected one argument" in error("sft", "--adam.lr", "-x")  # not a number: a flag
    assert "unexpected value '-1e-3'" in error("sft", "--adam.betas", "0.9", "0.95", "-1e-3")


def test_a_list_of_numbers_starting_with_a_minus_is_a_value_then_validated():
    args = ["--model.model_name_or_path", "m", "--data.dataset", "a.jsonl,b.jsonl"]
    with pytest.raises(ConfigError, match=r"^--data.dataset_probs -1,2: probabilities must be >= 0$"):
        parse_config("sft", [*args, "--data.dataset_probs", "-1,2"], device="cpu")
    cfg = parse_config("sft", [*args, "--data.dataset_probs", "-0.5, 1.5"], check=False)
    assert cfg.data.dataset_probs == "-0.5, 1.5"
    assert "--adam.lr: expected one argument" in error("sft", "--adam.lr", "-1,x")
