"""Rules about flags that the trainers used to check while they set up (issue 49): each is refused by
`parse_config` now, before any file is read or any process starts; which roles an RL run has comes from
one place (`run_roles`); the TRL translation is a declared field of the config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from config_args import BASE
from test_validate import problem

from posttrain.config import (
    ConfigError,
    config_from_trl_rloo,
    config_to_dict,
    flag_specs,
    load_config,
    parse_config,
    save_config,
)
from posttrain.config.backends import vllm_missing


def test_ipo_with_label_smoothing():
    assert problem("dpo", "--model.ipo_enable", "--model.label_smoothing", "0.1") == (
        "--model.label_smoothing 0.1 is cDPO's; IPO (--model.ipo_enable) does not use it. Drop one of the "
        "two flags.")
    parse_config("dpo", BASE["dpo"] + ["--model.ipo_enable"])
    parse_config("dpo", BASE["dpo"] + ["--model.label_smoothing", "0.1"])


def test_reward_model_margin_needs_the_sigmoid_loss():
    assert problem("rm", "--model.margin_loss_enable", "--model.loss_type", "logexp") == (
        "--model.margin_loss_enable needs --model.loss_type sigmoid, got 'logexp': the logexp loss has no "
        "margin term. Drop one of the two flags.")
    parse_config("rm", BASE["rm"] + ["--model.margin_loss_enable"])


@pytest.mark.parametrize("trainer", ["rm", "ppo", "serve-rm"])
def test_value_head_prefix_is_an_identifier(trainer):
    argv = ["--reward.model_name_or_path", "m"] if trainer == "serve-rm" else BASE[trainer]
    for bad in ("value-head", "2head", ""):
        with pytest.raises(ValueError) as err:
            parse_config(trainer, argv + ["--ds.value_head_prefix", bad])
        shown = repr(bad) if not bad else bad
        assert err.value.problems == [
            f"--ds.value_head_prefix {shown}: must be a Python identifier such as score or value_head"]
    cfg = parse_config(trainer, argv + ["--ds.value_head_prefix", "value_head"])
    assert cfg.ds.value_head_prefix == "value_head"


@pytest.mark.parametrize("flag,value", [("--data.max_images_per_prompt", "1"),
                                        ("--data.image_key", "pictures")])
def test_reward_models_read_text_only(flag, value):
    assert problem("rm", flag, value) == (
        f"{flag} {value}: posttrain rm trains text-only reward models (a score model has no vision-language "
        "form here, and ppo / serve-rm score text); drop the flag")


VLLM_TP = ["--vllm.num_engines", "1", "--vllm.tensor_parallel_size", "2"]
TP_REFUSAL = ("--vllm.tensor_parallel_size 2: a vLLM engine with tensor parallelism runs on CPUs (vLLM's CPU "
              "build) in this version, not on GPUs (its Ray process is given one GPU); use "
              "--vllm.tensor_parallel_size 1 and more --vllm.num_engines")


@pytest.mark.skipif(vllm_missing() is not None, reason="the rule applies where vLLM engines run")
def test_vllm_tensor_parallel_is_refused_on_a_gpu_machine_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # vLLM's CUDA build would run here
    assert problem("ppo", *VLLM_TP, device="cuda") == TP_REFUSAL
    ppo = BASE["ppo"]
    parse_config("ppo", ppo + VLLM_TP, device="cpu")  # vLLM's CPU build runs it
    parse_config("ppo", ppo + VLLM_TP + ["--rollout.engine", "hf"], device="cuda")  # no vLLM engine
    parse_config("ppo", ppo + ["--vllm.tensor_parallel_size", "2"], device="cuda")  # no engines at all


@pytest.mark.skipif(vllm_missing() is not None, reason="the rule applies where vLLM engines run")
def test_the_engines_worker_refuses_vllm_tensor_parallel_on_its_own_gpu(monkeypatch):
    """A cluster whose head has no GPU passes start-up (decided on the head); the engine's worker, on a GPU,
    refuses with the same line before building anything."""
    from posttrain.trainers.rl.placement import workers

    cfg = parse_config("ppo", BASE["ppo"] + VLLM_TP, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as e:
        workers.build_vllm_engine(cfg, tok=None)
    assert str(e.value) == TP_REFUSAL


NO_CRITIC_NO_KL = ("--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0")


def ppo(*extra: str):
    return parse_config("ppo", BASE["ppo"] + list(extra), check=False)


def test_the_roles_of_a_run_are_computed_once_and_read_by_every_helper(monkeypatch, tmp_path):
    from posttrain.config.ray_mode import (
        data_parallel,
        present_roles,
        ray_reason,
        reference_in_actor,
        run_roles,
        several_ranks,
        uses_ray,
    )

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    reward_model = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl",
                    "--reward.model_name_or_path", str(tmp_path), *NO_CRITIC_NO_KL]
    cases = {
        "gae": ppo("--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0.01"),
        "ranks": ppo("--actor.num_gpus_per_node", "2", *NO_CRITIC_NO_KL),
        "engines": ppo("--vllm.num_engines", "1", *NO_CRITIC_NO_KL),
        "lora": ppo("--ds.lora.rank", "4", "--algo.advantage.estimator", "reinforce",
                    "--algo.kl.init_coef", "0.01", "--ref.num_gpus_per_node", "2"),
        "rm": parse_config("ppo", reward_model, check=False),
    }
    expected = {  # roles, reference in the actor, several ranks, on Ray, data parallel
        "gae": (["actor", "ref", "critic"], False, None, False, False),
        "ranks": (["actor"], False, "--actor.num_nodes 1 x --actor.num_gpus_per_node 2", True, True),
        "engines": (["actor"], False, None, True, False),
        "lora": (["actor"], True, None, False, False),  # no ref role: its 2 ranks start no Ray
        "rm": (["actor", "reward"], False, None, False, False),
    }
    for name, cfg in cases.items():
        roles = run_roles(cfg)
        got = (list(roles.sections), roles.reference_in_actor, roles.several_ranks, roles.on_ray,
               roles.data_parallel)
        assert got == expected[name], name
        assert all(roles.has(r) for r in roles.sections) and not roles.has("nothing")
        # the helpers are readings of it
        assert (list(present_roles(cfg)), reference_in_actor(cfg), several_ranks(cfg), uses_ray(cfg),
                data_parallel(cfg)) == got
        assert ray_reason(cfg) == roles.ray_reason
    assert run_roles(cases["engines"]).ray_reason == "--vllm.num_engines 1"
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert run_roles(cases["gae"]).ray_reason == "RAY_ADDRESS=ray://head:10001"


def test_the_trl_translation_is_a_declared_field_not_a_flag(tmp_path):
    trl = {"rloo_k": 4, "sft_model_path": "m", "dataset_name": "p.jsonl", "total_episodes": 64}
    cfg = config_from_trl_rloo(trl, ["--reward.remote_url", "r.py"], check=False)
    assert "rloo_k: 4" in cfg.trl_translation.report()
    assert set(vars(cfg)) - {f.name for f in dataclasses.fields(cfg)} <= {"_posttrain_flag_sources"}
    assert "trl_translation" not in {s.path.split(".")[0] for s in flag_specs(type(cfg))}
    assert "trl_translation" not in config_to_dict(cfg)
    path = save_config(cfg, tmp_path / "config.yaml")
    again = load_config(path)  # the saved flags load back as a posttrain config, equal to the translated one
    assert again.trl_translation is None and again == cfg
    assert ppo().trl_translation is None


def test_colocation_sizes_that_do_not_fit_are_refused_at_start_up(monkeypatch):
    """OpenRLHF's colocation asserts (`config.placement_plan`), which a run on Ray met only when it placed its
    roles, after its data and models had loaded."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    two = ["--actor.num_gpus_per_node", "2"]
    assert problem("ppo", *two, "--vllm.num_engines", "2", "--train.colocate_all") == (
        "--train.colocate_all needs --ref.num_nodes/--ref.num_gpus_per_node equal to the actor's "
        "(1 x 1 vs 1 x 2)")
    assert problem("ppo", *two, "--ref.num_gpus_per_node", "2", "--vllm.num_engines", "1",
                   "--train.colocate_all") == (
        "--train.colocate_all needs --actor.num_nodes x --actor.num_gpus_per_node equal to "
        "--vllm.num_engines x --vllm.tensor_parallel_size (2 vs 1); or set --train.async_enable to give the "
        "engines their own GPUs")
    own_rewards = [a for a in BASE["ppo"] if a not in ("--reward.remote_url", "r.py")]
    critic_reward = ["--reward.model_name_or_path", "rm", "--algo.advantage.estimator", "gae",
                     "--critic.num_gpus_per_node", "2", "--train.colocate_critic_reward"]
    assert problem("ppo", *own_rewards, *critic_reward, base=False) == (
        "--train.colocate_critic_reward needs --reward.num_nodes/--reward.num_gpus_per_node equal to the "
        "critic's (1 x 1 vs 1 x 2)")
    parse_config("ppo", BASE["ppo"] + [*two, "--ref.num_gpus_per_node", "2", "--vllm.num_engines", "2",
                                       "--train.colocate_all"])
    parse_config("ppo", BASE["ppo"] + ["--train.colocate_all"])  # one process: nothing is placed


def test_the_placement_plan_reads_the_runs_roles_and_engine_count(monkeypatch):
    from posttrain.config.placement_plan import engine_count, plan_of

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = lambda *extra: parse_config("ppo", BASE["ppo"] + list(extra), check=False)  # noqa: E731
    assert engine_count(cfg("--vllm.num_engines", "3")) == 3
    assert engine_count(cfg("--actor.num_gpus_per_node", "2")) == 1
    hybrid = cfg("--actor.num_gpus_per_node", "4", "--ref.num_gpus_per_node", "4", "--train.colocate_all",
                 "--vllm.tensor_parallel_size", "2")
    assert engine_count(hybrid) == 2  # one per tp actor bundles, sharing them
    plan = plan_of(hybrid)
    assert set(plan.roles) == {"actor", "ref", "critic", "engine"}  # GAE (the default): a critic
    assert plan.groups == {"all": 4}
    assert plan.roles["engine"].bundles == (0, 2) and plan.roles["engine"].span == 2
    assert plan.roles["critic"].group == "all"
    no_ref = cfg("--algo.kl.init_coef", "0", "--vllm.num_engines", "1")
    assert set(plan_of(no_ref).roles) == {"actor", "critic", "engine"}
