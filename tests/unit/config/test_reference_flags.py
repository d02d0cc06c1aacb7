"""Every flag of the OpenRLHF 0.10.2 CLI reference parses for the trainers that own it; every old flag of
its migration table is rejected with its replacement named; removed flags are rejected as removed."""

from __future__ import annotations

import re

import pytest

from posttrain.config import TRAINERS, ConfigError, config_class, flag_specs, known_flags, parse_config
from posttrain.config.spec import get_path

SINGLE = ("sft", "rm", "dpo")
ALL = TRAINERS
PPO = ("ppo",)

# Which trainers own a flag: by section, with the exceptions the reference marks (PPO), (SFT), (RM), ...
OWNERS = {
    **{
        f"data.{k}": PPO
        for k in (
            "prompt_dataset",
            "prompt_probs",
            "prompt_split",
            "label_key",
            "image_key",
            "max_images_per_prompt",
        )
    },
    **{f"data.{k}": SINGLE for k in ("dataset", "dataset_probs", "dataset_split")},
    "data.output_key": ("sft",),
    "data.multiturn": ("sft",),
    "data.input_key": ("sft", "ppo"),
    **{f"data.{k}": ("rm", "dpo") for k in ("prompt_key", "chosen_key", "rejected_key")},
    **{
        f"train.{k}": PPO
        for k in (
            "num_episodes",
            "async_enable",
            "async_queue_size",
            "partial_rollout_enable",
            "enable_ema",
            "ema_beta",
            "agent_func_path",
            "colocate_actor_ref",
            "colocate_critic_reward",
            "colocate_all",
        )
    },
    "eval.temperature": PPO,
    "eval.n_samples_per_prompt": PPO,
    "ckpt.best_metric_key": PPO,
    "ds.enable_sleep": PPO,
    "ds.value_head_prefix": ("rm", "ppo"),
    **{f"model.{k}": ("dpo",) for k in ("beta", "ipo_enable", "label_smoothing", "nll_loss_coef")},
    **{f"model.{k}": ("rm",) for k in ("loss_type", "compute_fp32_loss_enable", "margin_loss_enable")},
    "model.pretrain_mode_enable": ("sft",),
    "ref.model_name_or_path": ("dpo", "ppo"),
    "ref.offload": ("dpo", "ppo"),
    "local_rank": ALL,
    "use_ms": ALL,
}


def owners(flag: str) -> tuple[str, ...]:
    name = flag[2:]
    if name in OWNERS:
        return OWNERS[name]
    root = name.split(".")[0]
    if root in ("vllm", "rollout", "algo", "actor", "critic", "reward", "ref"):
        return PPO
    if root in ("model", "adam", "muon") or "." not in name:
        return SINGLE  # single-model namespace and the flat optimizer flags
    return ALL  # ds, data, train, eval, ckpt, logger


def argv_and_expected(trainer: str, flag: str):
    """Command-line tokens giving `flag` a valid non-default value, and the path/value to expect."""
    specs = {s.flag: s for s in flag_specs(config_class(trainer))}
    negations = {s.negation_flag: s for s in specs.values() if s.negation_flag}
    if flag in negations:
        return [flag], negations[flag].path, False
    spec = specs[flag]
    if spec.base is bool:
        return [flag], spec.path, True
    if spec.choices:
        value = next((c for c in spec.choices if c != spec.default), spec.choices[0])
    elif spec.base is int:
        value = 3 if spec.default != 3 else 1
    elif spec.base is float:
        value = 0.375
    else:
        value = "some_value"
    if spec.is_list:
        values = (
            [value, value * 2 if spec.base is not str else "v_proj"] if spec.nargs == 2 else [value, "v_proj"]
        )
        return [flag, *map(str, values)], spec.path, values
    return [flag, str(value)], spec.path, value


def test_reference_was_parsed(reference):
    assert len(reference["current"]) > 150
    assert len(reference["old"]) > 120
    assert {
        "--ds.lora.rank",
        "--logger.wandb.run_name",
        "--actor.muon.lr",
        "--critic.adam.weight_decay",
        "--algo.advantage.is_correction_threshold",
        "--muon.no_nesterov",
    } <= set(reference["current"])
    assert {"--pretrain", "--actor_num_gpus_per_node", "--l2", "--data.prompt"} <= reference["old"]


def test_every_reference_flag_parses_for_each_owner(reference):
    missing, wrong = [], []
    for flag in reference["current"]:
        for trainer in owners(flag):
            if flag not in known_flags(trainer):
                missing.append(f"{flag} ({trainer})")
                continue
            tokens, path, expected = argv_and_expected(trainer, flag)
            cfg = parse_config(trainer, tokens, check=False)
            if get_path(cfg, path) != expected:
                wrong.append(f"{' '.join(tokens)} ({trainer}) -> {get_path(cfg, path)!r}")
            cfg2 = parse_config(
                trainer, [f"{tokens[0]}={tokens[1]}"] if len(tokens) == 2 else tokens, check=False
            )
            assert get_path(cfg2, path) == expected, f"{flag}=value form ({trainer})"
    assert not missing, f"flags of the reference missing from the config: {missing}"
    assert not wrong, f"flags parsed to the wrong value: {wrong}"


def test_ppo_only_flags_are_rejected_by_single_model_trainers():
    with pytest.raises(ConfigError, match=r"--rollout.n_samples_per_prompt: it is a flag of posttrain ppo"):
        parse_config("sft", ["--rollout.n_samples_per_prompt", "4"], check=False)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_old_flags_name_their_replacement(reference, trainer):
    known = known_flags(trainer)
    real = set().union(
        *(known_flags(t) for t in TRAINERS)
    )  # the table abbreviates: "--algo.kl.init_coef / ...target"
    checked = 0
    for old, new in reference["renames"]:
        for flag in old:
            if flag in known:
                continue
            value = [] if flag.startswith("--no_") else ["1"]
            with pytest.raises(ConfigError) as err:
                parse_config(trainer, [flag, *value], check=False)
            msg = str(err.value)
            assert f"unknown flag {flag}:" in msg, msg
            if flag in reference["old"]:  # (--lr_scheduler is current in SFT and per-entity in PPO)
                assert "renamed in OpenRLHF 0.10.2" in msg or "removed in OpenRLHF 0.10.2" in msg, msg
            named = set(re.findall(r"--[\w.]+", msg.split(":", 1)[1]))
            assert named & (set(new) | real), f"{flag} ({trainer}): no replacement named in {msg!r}"
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("trainer", TRAINERS)
def test_removed_flags_are_reported_as_removed(reference, trainer):
    assert {"--ptx_coef", "--actor.ptx_coef", "--train.perf_tracking_enable"} <= reference["removed"]
    for flag in reference["removed"]:
        with pytest.raises(ConfigError, match=rf"{re.escape(flag)}: removed in OpenRLHF 0.10.2"):
            parse_config(trainer, [flag], check=False)


def test_flag_the_reference_says_does_not_exist_is_rejected():
    with pytest.raises(ConfigError, match="unknown flag --muon.weight_decay"):
        parse_config("sft", ["--muon.weight_decay", "0.1"], check=False)
