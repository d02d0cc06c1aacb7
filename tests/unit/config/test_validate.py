"""Each validation rule, with the message it gives; all problems are reported together."""

from __future__ import annotations

import warnings

import pytest
from config_args import BASE

from posttrain.config import ConfigError, ConfigWarning, parse_config, validate


def problems(
    trainer: str, *extra: str, base: bool = True, world_size: int = 1, device: str = "cpu"
) -> list[str]:
    argv = (BASE[trainer] if base else []) + list(extra)
    with pytest.raises(ConfigError) as err:
        parse_config(trainer, argv, world_size=world_size, device=device)
    return err.value.problems


def problem(trainer: str, *extra: str, **kw) -> str:
    found = problems(trainer, *extra, **kw)
    assert len(found) == 1, found
    return found[0]


def warns(trainer: str, *extra: str, device: str = "cpu", world_size: int = 1) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse_config(trainer, BASE[trainer] + list(extra), device=device, world_size=world_size)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def cfg_for(trainer: str, *extra: str):
    return parse_config(trainer, BASE[trainer] + list(extra), check=False)


@pytest.mark.parametrize("trainer", ["sft", "rm", "dpo", "ppo"])
def test_base_configs_are_valid(trainer):
    assert warns(trainer) == []


def test_model_and_dataset_are_required():
    found = problems("sft", base=False)
    assert found == [
        "--model.model_name_or_path: required: a model folder or hub id",
        "--data.dataset: required: a dataset path or HF name",
    ]  # each flag's own facts are checked in --help order
    found = problems("ppo", base=False)
    assert "--data.prompt_dataset: required: a dataset path or HF name" in found
    assert "--actor.model_name_or_path: required: the policy model folder or hub id" in found
    assert any(p.startswith("--reward.model_name_or_path: a reward source is required") for p in found)


def test_engine_rules():
    assert problem("sft", "--ds.zero_stage", "4") == "--ds.zero_stage 4: valid values: 0, 1, 2, 3"
    cfg = cfg_for("sft")
    cfg.ds.param_dtype, cfg.optim = "int8", "sgd"  # values only a program (not argparse) can set
    with pytest.raises(ConfigError) as err:
        validate(cfg, device="cpu")
    assert err.value.problems == [
        "--optim sgd: invalid choice 'sgd'; valid values: adam, muon",
        "--ds.param_dtype int8: invalid choice 'int8'; valid values: bf16, fp16, fp32, None",
    ]
    assert problem("sft", "--optim", "muon", "--ds.adam_offload").startswith(
        "--optim muon: Muon keeps its state on the accelerator: not compatible with --ds.adam_offload"
    )
    assert problem("ppo", "--critic.optim", "muon", "--ds.adam_offload").startswith("--critic.optim muon:")
    assert problem("sft", "--ds.tensor_parallel_size", "2", "--ds.zero_stage", "3", world_size=2) == (
        "--ds.tensor_parallel_size 2: AutoTP works only with --ds.zero_stage 0, 1 or 2"
    )
    assert "valid values: eager, sdpa" in problem("sft", "--ds.attn_implementation", "flash")


def test_tensor_parallel_without_replicas_points_to_zero_0():
    tp = ("--ds.tensor_parallel_size", "2", "--ds.zero_stage")
    def tp_warnings(*extra, world_size=2, device="cpu"):
        return [x for x in warns("sft", *tp, *extra, world_size=world_size, device=device)
                if "tensor_parallel" in x]

    (w,) = tp_warnings("2")
    assert w.startswith("--ds.tensor_parallel_size 2 on 2 ranks leaves ZeRO-2 nothing to partition (one "
                        "data-parallel replica)") and w.endswith("--ds.zero_stage 0 trains the same")
    assert tp_warnings("1")
    assert not tp_warnings("0")
    assert not tp_warnings("2", world_size=4)  # 2 replicas
    # DeepSpeed's ZeRO group is every rank of a tensor-parallel index, ring ranks included:
    # it partitions there
    assert not tp_warnings("2", "--ds.ring_attn_size", "2", "--ds.packing_samples", "--train.batch_size", "8",
                           world_size=4)
    # bf16 (the GPU default): ZeRO-1/2 keep an fp32 master copy that ZeRO-0 would not: not the same training
    assert not tp_warnings("2", device="cuda")


def test_lora_rules():
    assert problem("sft", "--ds.lora.rank", "-1") == "--ds.lora.rank -1: must be >= 0 (0 disables LoRA)"
    assert problem("sft", "--ds.lora.alpha", "0") == "--ds.lora.alpha 0: must be > 0"
    assert problem("sft", "--ds.lora.dropout", "1.0") == "--ds.lora.dropout 1.0: must be in [0, 1)"
    assert problem("sft", "--ds.lora.rank", "8", "--ds.lora.target_modules").startswith(
        "--ds.lora.target_modules: give module names"
    )


def test_asking_for_vllm_without_rollout_engines_is_an_error():
    """--rollout.engine vllm says vLLM must sample; one process (no --vllm.num_engines) samples with the HF
    engine over the actor's module, so the run stops with the flag that runs vLLM instead of ignoring it."""
    assert problem("ppo", "--rollout.engine", "vllm") == (
        "--rollout.engine vllm: vLLM runs in rollout engines of their own: add --vllm.num_engines 1 (on "
        "Ray); one process samples with the HF engine over the actor's module")
    assert warns("ppo", "--rollout.engine", "hf") == []
    cfg_for("ppo", "--rollout.engine", "vllm", "--vllm.num_engines", "1")  # parses; the engine worker decides


def test_4bit_needs_lora_and_cuda():
    assert problem("sft", "--ds.load_in_4bit", device="cuda") == (
        "--ds.load_in_4bit: 4-bit weights cannot be trained; use it with LoRA (--ds.lora.rank > 0)"
    )
    assert problem("sft", "--ds.load_in_4bit", "--ds.lora.rank", "8", device="cpu") == (
        "--ds.load_in_4bit: bitsandbytes 4-bit loading needs a CUDA GPU; this run is on CPU"
    )
    assert warns("sft", "--ds.load_in_4bit", "--ds.lora.rank", "8", device="cuda") == []
    qlora = ("--ds.load_in_4bit", "--ds.lora.rank", "8")
    assert warns("ppo", *qlora, device="cuda") == []
    for extra in (("--train.async_enable",), ("--vllm.num_engines", "1")):
        assert problem("ppo", *qlora, *extra, device="cuda").startswith(
            "--ds.load_in_4bit: a QLoRA actor cannot sync its weights to rollout engines"), extra


def test_bf16_on_cpu_is_allowed_with_a_warning():
    (w,) = warns("sft", "--ds.param_dtype", "bf16", device="cpu")
    assert "--ds.param_dtype bf16 on CPU" in w and "~140x slower" in w
    assert warns("sft", "--ds.param_dtype", "bf16", device="cuda") == []


def test_batch_divisibility():
    assert problem("sft", "--train.batch_size", "10", "--train.micro_batch_size", "4") == (
        "--train.batch_size 10: must be divisible by --train.micro_batch_size x world size = 4 x 1 = 4 (e.g. "
        "8)"
    )
    assert "= 8 x 2 = 16" in problem("sft", "--train.batch_size", "8", world_size=2)
    assert warns("sft", "--train.batch_size", "32", "--train.micro_batch_size", "8", world_size=4) == []
    # dynamic batching forms micro-batches by tokens: only the world size must divide the batch
    assert (
        warns(
            "sft",
            "--train.batch_size",
            "10",
            "--train.micro_batch_size",
            "4",
            "--train.dynamic_batch_enable",
            "--train.max_tokens_per_gpu",
            "4096",
        )
        == []
    )
    assert (
        problem(
            "sft",
            "--train.batch_size",
            "9",
            "--train.dynamic_batch_enable",
            "--train.max_tokens_per_gpu",
            "4096",
            world_size=2,
        )
        == "--train.batch_size 9: must be divisible by the world size 2"
    )


def test_dynamic_batch_needs_a_token_budget():
    assert problem("sft", "--train.dynamic_batch_enable") == (
        "--train.dynamic_batch_enable: needs --train.max_tokens_per_gpu > 0 (the token budget)"
    )
    (w,) = warns("sft", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "512")
    assert "--train.max_tokens_per_gpu 512 < --data.max_len 2048" in w


def test_data_rules():
    assert problem("sft", "--data.multiturn") == (
        "--data.multiturn: needs --data.apply_chat_template (turns are found through the chat template)"
    )
    assert warns("sft", "--data.multiturn", "--data.apply_chat_template") == []
    assert problem("sft", "--data.dataset", "a.jsonl,b.jsonl", "--data.dataset_probs", "0.2,0.3,0.5") == (
        "--data.dataset_probs 0.2,0.3,0.5: 3 probabilities for 2 datasets in --data.dataset"
    )
    assert problem("sft", "--data.dataset", "a.jsonl,b.jsonl", "--data.dataset_probs", "0.2,0.3") == (
        "--data.dataset_probs 0.2,0.3: probabilities must sum to 1 (they sum to 0.5)"
    )
    assert "expected comma-separated numbers" in problem("sft", "--data.dataset_probs", "half")
    assert warns("sft", "--data.dataset", "a.jsonl,b.jsonl", "--data.dataset_probs", "0.25,0.75") == []
    assert "--data.prompt_probs 0.5: probabilities must sum to 1" in problem(
        "ppo", "--data.prompt_probs", "0.5"
    )
    assert problem("sft", "--data.input_template", "no placeholder") == (
        "--data.input_template 'no placeholder': must contain {} where the prompt goes"
    )
    (w,) = warns("sft", "--data.input_template", "User: {}\\nAssistant: ")
    assert "literal backslash-n" in w


def test_scheduler_and_optimizer_ranges():
    assert problem("sft", "--lr_warmup_ratio", "1.5") == "--lr_warmup_ratio 1.5: must be in [0, 1]"
    assert problem("sft", "--min_lr_ratio", "-0.1") == "--min_lr_ratio -0.1: must be in [0, 1]"
    assert (
        problem("ppo", "--critic.lr_warmup_ratio", "2") == "--critic.lr_warmup_ratio 2.0: must be in [0, 1]"
    )
    assert problem("sft", "--adam.betas", "0.9", "1.0") == "--adam.betas 0.9 1.0: each beta must be in [0, 1)"
    assert problem("sft", "--lr_warmup_steps", "-1") == "--lr_warmup_steps -1: must be >= 0"


def test_schedules_that_cannot_run_are_refused_with_the_reason():
    for name in ("reduce_lr_on_plateau", "greedy"):
        assert problem("sft", "--lr_scheduler", name) == (
            f"--lr_scheduler {name}: {name} changes the learning rate from a metric handed to it after each "
            "evaluation, and posttrain's schedules are functions of the optimizer step; use a step schedule "
            "(cosine_with_min_lr, linear, warmup_stable_decay, ...)")
    assert problem("ppo", "--actor.lr_scheduler", "polynomial", "--actor.adam.lr", "1e-7") == (
        "--actor.adam.lr 1e-07: --actor.lr_scheduler polynomial decays to the learning rate 1e-07 "
        "(transformers' lr_end), so it must start above that; raise it or use linear")
    parse_config("sft", BASE["sft"] + ["--lr_scheduler", "polynomial", "--adam.lr", "1e-5"], device="cpu")
    with pytest.raises(ConfigError, match="invalid choice 'cosine_restart'; valid values: linear, cosine, "
                       "cosine_with_restarts, polynomial, constant, "):  # transformers' schedule names
        parse_config("sft", BASE["sft"] + ["--lr_scheduler", "cosine_restart"], device="cpu")


def test_checkpoint_rules():
    assert problem("sft", "--ckpt.load_enable", "--ckpt.path", "") == (
        "--ckpt.load_enable: needs --ckpt.path (where the checkpoints are)"
    )
    assert problem("sft", "--ckpt.save_steps", "0") == "--ckpt.save_steps 0: must be -1 (never) or >= 1"
    assert problem("sft", "--eval.steps", "0") == ("--eval.steps 0: must be -1 (only the last step; ppo also "
                                                   "evaluates step 0, the starting model, unless "
                                                   "--ckpt.best_metric_key none) or >= 1")


def test_dpo_rules():
    assert problem("dpo", "--model.beta", "0") == "--model.beta 0.0: must be > 0"
    assert (
        problem("dpo", "--model.label_smoothing", "0.5") == "--model.label_smoothing 0.5: must be in [0, 0.5)"
    )


def test_ppo_estimators_need_groups():
    for est in ("rloo", "reinforce_baseline", "group_norm", "dr_grpo"):
        assert problem("ppo", "--algo.advantage.estimator", est) == (
            f"--algo.advantage.estimator {est}: a group estimator needs --rollout.n_samples_per_prompt >= 2 "
            f"(got 1)"
        )
        assert warns("ppo", "--algo.advantage.estimator", est, "--rollout.n_samples_per_prompt", "4") == []
    assert warns("ppo", "--algo.advantage.estimator", "reinforce") == []
    (w,) = warns(
        "ppo",
        "--algo.advantage.estimator",
        "group_norm",
        "--rollout.n_samples_per_prompt",
        "4",
        "--algo.advantage.gamma",
        "0.9",
    )
    assert "ignored by group_norm" in w


def test_ppo_rollout_sizes():
    assert problem(
        "ppo", "--rollout.batch_size", "6", "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "8"
    ) == (
        "--train.batch_size 8: must divide the samples per rollout --rollout.batch_size x "
        "--rollout.n_samples_per_prompt = 6 x 2 = 12"
    )
    assert problem("ppo", "--rollout.vllm_generate_batch_size", "32") == (
        "--rollout.vllm_generate_batch_size 32: larger than --rollout.batch_size 16 needs "
        "--train.async_enable (oversampling)"
    )
    assert warns("ppo", "--rollout.vllm_generate_batch_size", "32", "--train.async_enable") == []
    assert problem("ppo", "--rollout.max_new_tokens", "2048") == (
        "--rollout.max_new_tokens 2048: must be in [1, --data.max_len 2048) to leave room for the prompt"
    )
    assert problem("ppo", "--rollout.top_p", "0") == "--rollout.top_p 0.0: must be in (0, 1]"


def test_ppo_kl_and_loss_rules():
    (w,) = warns("ppo", "--algo.kl.use_loss")
    assert "use k2 or k3 as a loss" in w
    assert warns("ppo", "--algo.kl.use_loss", "--algo.kl.estimator", "k3") == []
    assert problem("ppo", "--algo.kl.target", "0") == (
        "--algo.kl.target 0.0: must be > 0 (or unset for a fixed coefficient)"
    )
    cfg = cfg_for("ppo")
    cfg.algo.kl.estimator, cfg.actor.policy_loss_type = "k4", "grpo"
    with pytest.raises(ConfigError) as err:
        validate(cfg, device="cpu")
    assert err.value.problems == [
        "--actor.policy_loss_type grpo: invalid choice 'grpo'; valid values: ppo, gspo, seq_sum",
        "--algo.kl.estimator k4: invalid choice 'k4'; valid values: k1, k2, k3",
    ]
    assert problem("ppo", "--actor.dual_clip", "1.0") == "--actor.dual_clip 1.0: must be > 1"
    assert problem("ppo", "--algo.advantage.is_correction_threshold", "5", "0.5") == (
        "--algo.advantage.is_correction_threshold 5.0 0.5: needs low < high"
    )
    assert problem("ppo", "--algo.advantage.gamma", "1.5") == "--algo.advantage.gamma 1.5: must be in [0, 1]"


def test_ppo_filtering_shaping_and_async_rules():
    found = problems("ppo", "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "1", "0")
    assert found == [
        "--algo.dynamic_filtering_range 1.0 0.0: needs low < high",
        "--algo.dynamic_filtering_enable: needs --rollout.n_samples_per_prompt >= 2",
    ]
    assert (
        problem("ppo", "--reward.clip_range", "10", "-10")
        == "--reward.clip_range 10.0 -10.0: needs low < high"
    )
    assert problem("ppo", "--reward.overlong_buffer_len", "512", "--rollout.max_new_tokens", "256") == (
        "--reward.overlong_buffer_len 512.0: must be <= --rollout.max_new_tokens 256"
    )
    assert problem("ppo", "--reward.stop_properly_penalty_coef", "1.5").startswith(
        "--reward.stop_properly_penalty_coef 1.5: must be in [0, 1] (scale) or < 0"
    )
    assert (
        problem("ppo", "--train.partial_rollout_enable")
        == "--train.partial_rollout_enable: needs --train.async_enable"
    )
    assert problem("ppo", "--train.async_enable", "--vllm.enable_sleep") == (
        "--vllm.enable_sleep: not compatible with --train.async_enable"
    )


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        parse_config(
            "sft",
            ["--ds.zero_stage", "5", "--ds.lora.alpha", "0", "--data.multiturn", "--lr_warmup_ratio", "2"],
            device="cpu",
        )
    msg = str(err.value)
    assert msg.startswith("invalid configuration (6 problems):\n  - ")
    for part in (
        "--ds.zero_stage 5",
        "--ds.lora.alpha 0",
        "--data.multiturn",
        "--lr_warmup_ratio 2.0",
        "--data.dataset: required",
        "--model.model_name_or_path: required",
    ):
        assert part in msg


def test_world_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"= 8 x 3 = 24"):
        parse_config("sft", BASE["sft"], device="cpu")


def test_one_reward_source_exactly():
    ppo = list(BASE["ppo"])
    both = problems("ppo", "--reward.model_name_or_path", "rm_dir")
    assert both == [
        "--reward.model_name_or_path rm_dir and --reward.remote_url r.py: a run takes its rewards from one "
        "source; drop one"
    ]
    i = ppo.index("--reward.remote_url")
    none = problems("ppo", *(ppo[:i] + ppo[i + 2 :]), base=False)
    assert none == [
        "--reward.model_name_or_path: a reward source is required: --reward.model_name_or_path (a reward "
        "model), --reward.remote_url (an http(s) reward server or a .py file defining reward_func), "
        "--reward.func_path (reward function files), --train.agent_func_path (an agent file whose "
        "environment returns rewards) or --teacher.model_name_or_path (on-policy distillation: the teacher's "
        "per-token reward alone)"
    ]
    # an agent file is a reward source of its own (its environment returns the rewards)
    parse_config("ppo", ppo[:i] + ppo[i + 2:] + ["--train.agent_func_path", "agent.py"], device="cpu")
    assert "\n" not in both[0] and "\n" not in none[0]


def test_reward_function_files_and_their_weights():
    ppo = list(BASE["ppo"])
    i = ppo.index("--reward.remote_url")
    alone = ppo[:i] + ppo[i + 2:]
    parse_config("ppo", alone + ["--reward.func_path", "a.py", "b.py:short"], device="cpu")  # a source
    parse_config("ppo", ppo + ["--reward.func_path", "a.py", "--reward.model_weight", "0.5"], device="cpu")
    assert problems("ppo", "--reward.func_path", "a.py", "b.py", "--reward.func_weights", "1") == [
        "--reward.func_weights has 1 weights for 2 --reward.func_path files; give one weight per file (or "
        "none: 1 each)"]
    assert problems("ppo", "--reward.func_path", "a.py", "--reward.func_weights", "nan") == [
        "--reward.func_weights nan: must be a finite number"]
    assert problems("ppo", "--reward.func_path", "x/a.py", "y/a.py", "mean.py", "c.txt") == [
        "--reward.func_path entries 1 and 2 are both named 'a' (reward/<name>); rename a file or give "
        "FILE.py:FUNCTION",
        "--reward.func_path entry 3 ('mean.py'): its term name 'mean' is reserved (reward/mean is another "
        "metric); rename the file or give FILE.py:FUNCTION",
        "--reward.func_path entry 4 ('c.txt'): expected a .py file defining reward_func, or FILE.py:FUNCTION"]


def test_agent_flags_are_checked():
    assert problem("ppo", "--train.agent_func_path", "agent.txt") == (
        "--train.agent_func_path agent.txt: must be a .py file defining AgentExecutor")
    assert problem("ppo", "--agent.timeout", "0") == "--agent.timeout 0.0: must be > 0 seconds"
    assert (problem("ppo", "--agent.max_failure_frac", "1.5")
            == "--agent.max_failure_frac 1.5: must be in [0, 1]")


def test_a_tool_file_is_refused_with_an_agent_file_or_without_the_chat_template():
    assert problem("ppo", "--train.tool_path", "tools.txt") == (
        "--train.tool_path tools.txt: must be a .py file of tool functions")
    assert problem("ppo", "--train.tool_path", "tools.py", "--train.agent_func_path", "agent.py",
                   "--data.apply_chat_template") == (
        "--train.tool_path tools.py: refused together with --train.agent_func_path agent.py: a run has one "
        "environment; drop one")
    assert problem("ppo", "--train.tool_path", "tools.py") == (
        "--train.tool_path tools.py: needs --data.apply_chat_template (the prompts are rendered with the "
        "tools' schemas)")
    parse_config("ppo", BASE["ppo"] + ["--train.tool_path", "tools.py", "--data.apply_chat_template"],
                 device="cpu")


def test_gspo_aggregates_per_sequence_by_default(tmp_path):
    from posttrain.config import format_config, inert_flags, load_config, resolved_values, save_config

    gspo = parse_config("ppo", BASE["ppo"] + ["--actor.policy_loss_type", "gspo"], device="cpu")
    assert gspo.actor.loss_agg == "seq_mean_token_mean"
    why = "auto for --actor.policy_loss_type gspo"
    assert resolved_values(gspo)["actor.loss_agg"] == (None, "seq_mean_token_mean", why)
    assert f"   loss_agg = seq_mean_token_mean  ({why})" in format_config(gspo).splitlines()
    assert inert_flags(gspo, "cpu") == []
    validate(gspo, device="cpu")  # validating again keeps the auto value
    assert gspo.actor.loss_agg == "seq_mean_token_mean"
    save_config(gspo, tmp_path / "run.yaml")
    assert load_config(tmp_path / "run.yaml", check=True) == gspo
    assert cfg_for("ppo").actor.loss_agg is None  # unset until validation resolves it
    assert parse_config("ppo", BASE["ppo"], device="cpu").actor.loss_agg == "token_mean"
    kept = parse_config(
        "ppo",
        BASE["ppo"] + ["--actor.policy_loss_type", "gspo", "--actor.loss_agg", "seq_sum_norm"],
        device="cpu",
    )
    assert kept.actor.loss_agg == "seq_sum_norm" and "actor.loss_agg" not in resolved_values(kept)


def test_gspo_with_token_mean_is_refused():
    assert problem("ppo", "--actor.policy_loss_type", "gspo", "--actor.loss_agg", "token_mean") == (
        "--actor.loss_agg token_mean: GSPO's importance ratio is per sequence, and a token mean would weight "
        "each sequence by its length; leave --actor.loss_agg unset (auto: seq_mean_token_mean, as OpenRLHF)"
    )
    assert warns("ppo", "--actor.loss_agg", "token_mean") == []


def test_trl_rloo_flags(tmp_path):
    """TRL RLOO (issue 14): seq_sum aggregates per sequence by default and refuses token_mean like gspo;
    the score-pipeline flags are validated; a flag that needs another one says so."""
    from posttrain.config import inert_flags, resolved_values

    seq_sum = parse_config("ppo", BASE["ppo"] + ["--actor.policy_loss_type", "seq_sum"], device="cpu")
    assert seq_sum.actor.loss_agg == "seq_mean_token_mean"
    assert resolved_values(seq_sum)["actor.loss_agg"] == (
        None, "seq_mean_token_mean", "auto for --actor.policy_loss_type seq_sum")
    assert problem("ppo", "--actor.policy_loss_type", "seq_sum", "--actor.loss_agg", "token_mean") == (
        "--actor.loss_agg token_mean: seq_sum's importance ratio is per sequence, and a token mean would "
        "weight each sequence by its length; leave --actor.loss_agg unset (auto: seq_mean_token_mean, as TRL "
        "RLOO)"
    )
    trl = ["--reward.missing_eos_penalty", "1.0", "--reward.batch_normalize_enable",
           "--reward.batch_normalize_clip", "0.5", "--algo.advantage.whiten_enable",
           "--algo.advantage.whiten_level", "sequence", "--actor.policy_loss_type", "seq_sum"]
    cfg = parse_config("ppo", BASE["ppo"] + trl, device="cpu")
    assert ((cfg.reward.missing_eos_penalty, cfg.reward.batch_normalize_enable,
             cfg.reward.batch_normalize_clip, cfg.algo.advantage.whiten_level)
            == (1.0, True, 0.5, "sequence"))
    assert inert_flags(cfg, "cpu") == []
    defaults = parse_config("ppo", BASE["ppo"], device="cpu")
    assert ((defaults.reward.missing_eos_penalty, defaults.reward.batch_normalize_enable,
             defaults.reward.batch_normalize_clip, defaults.algo.advantage.whiten_level)
            == (None, False, 10.0, "token"))
    alone = parse_config("ppo", BASE["ppo"] + ["--reward.batch_normalize_clip", "0.5",
                                               "--algo.advantage.whiten_level", "sequence"], device="cpu")
    assert inert_flags(alone, "cpu") == [
        "--reward.batch_normalize_clip 0.5 has no effect here: needs --reward.batch_normalize_enable",
        "--algo.advantage.whiten_level sequence has no effect here: needs --algo.advantage.whiten_enable",
    ]
    assert problem("ppo", "--reward.missing_eos_penalty", "-1") == (
        "--reward.missing_eos_penalty -1.0: must be a finite number >= 0 (it is subtracted from the reward)")
    assert problem("ppo", "--reward.missing_eos_penalty", "nan") == (
        "--reward.missing_eos_penalty nan: must be a finite number >= 0 (it is subtracted from the reward)")
    assert problem("ppo", "--reward.batch_normalize_clip", "0") == (
        "--reward.batch_normalize_clip 0.0: must be a finite number > 0")
    assert problem("ppo", "--algo.advantage.whiten_level", "batch") == (
        "--algo.advantage.whiten_level: invalid choice 'batch'; valid values: token, sequence")


@pytest.mark.parametrize("flag", ["--adam.lr", "--muon.lr"])
def test_negative_learning_rates_are_refused_by_validation(flag):
    assert problem("sft", flag, "-1e-3") == (
        f"{flag} -0.001: must be a finite number >= 0 (a learning rate cannot be negative)"
    )
    assert problem("ppo", "--actor.adam.lr", "-.5").startswith(
        "--actor.adam.lr -0.5: must be a finite number >= 0"
    )
    assert problem("ppo", "--critic.adam.lr", "-2").startswith(
        "--critic.adam.lr -2.0: must be a finite number"
    )
    assert problem("sft", flag, "inf").startswith(f"{flag} inf: must be a finite number >= 0")


@pytest.mark.parametrize("url",
                         ["ftp://host/rm", "rewards.txt", "http://", "http://a/x,b.py",
                          "http://a/x,,http://b/x"])
def test_reward_url_that_is_neither_a_server_nor_a_py_file_is_refused_before_loading(url):
    args = [a if a != "r.py" else url for a in BASE["ppo"]]
    with pytest.raises(ConfigError, match="reward.remote_url"):
        parse_config("ppo", args)


def test_several_reward_servers_are_accepted():
    args = [a if a != "r.py" else "http://a:5000/get_reward, https://b/get_reward" for a in BASE["ppo"]]
    assert parse_config("ppo", args).reward.remote_url == "http://a:5000/get_reward, https://b/get_reward"


def test_ray_placement_rules():
    from posttrain.config.ray_mode import data_parallel, present_roles, uses_ray

    one = parse_config("ppo", BASE["ppo"], check=False)
    # gae, KL in the reward
    assert not uses_ray(one) and list(present_roles(one)) == ["actor", "ref", "critic"]
    two = parse_config("ppo", BASE["ppo"] + ["--actor.num_gpus_per_node", "2"], check=False)
    assert uses_ray(two) and data_parallel(two)
    engines = parse_config("ppo", BASE["ppo"] + ["--vllm.num_engines", "1"], check=False)
    assert uses_ray(engines) and not data_parallel(engines)
    # a count on a role this run does not load does not start Ray (no critic without gae)
    no_critic = BASE["ppo"] + ["--algo.advantage.estimator", "rloo", "--rollout.n_samples_per_prompt", "2"]
    assert not uses_ray(parse_config("ppo", no_critic + ["--critic.num_gpus_per_node", "4"], check=False))
    with pytest.raises(ConfigError, match="--train.enable_ema: not available with --ds.zero_stage 3"):
        parse_config("ppo", BASE["ppo"] + ["--train.enable_ema", "--actor.num_gpus_per_node", "2",
                                           "--ds.zero_stage", "3"])


def test_a_lora_reference_from_the_actors_weights_is_the_adapter_off_actor(tmp_path):
    """LoRA + KL + no other reference: no ref role (`reference_in_actor`), so a ref rank count starts no Ray;
    the actor's own folder spelled differently is the same weights; another folder loads its own reference."""
    from posttrain.config.ray_mode import present_roles, reference_in_actor, uses_ray

    actor = tmp_path / "actor"
    actor.mkdir()
    base = BASE["ppo"] + ["--actor.model_name_or_path", str(actor), "--algo.kl.init_coef", "0.01"]
    lora = base + ["--ds.lora.rank", "8"]
    cfg = parse_config("ppo", lora + ["--ref.num_gpus_per_node", "2"], check=False)
    assert reference_in_actor(cfg) and "ref" not in present_roles(cfg) and not uses_ray(cfg)
    same = parse_config("ppo", lora + ["--ref.model_name_or_path", f"{actor}/."], check=False)
    assert reference_in_actor(same)
    other = parse_config("ppo", lora + ["--ref.model_name_or_path", str(tmp_path)], check=False)
    assert not reference_in_actor(other) and "ref" in present_roles(other)
    assert not reference_in_actor(parse_config("ppo", base, check=False))  # no LoRA: a reference copy
    no_kl = parse_config("ppo", lora + ["--algo.kl.init_coef", "0"], check=False)
    assert not reference_in_actor(no_kl) and "ref" not in present_roles(no_kl)


def test_ring_attention_needs_packing_and_a_group_that_divides_the_ranks():
    from posttrain.config import parse_config
    from posttrain.utils.errors import ConfigError

    base = ["--model.model_name_or_path", "m", "--data.dataset", "d", "--ds.ring_attn_size", "2"]
    with pytest.raises(ConfigError, match=r"--ds.ring_attn_size 2: needs --ds.packing_samples"):
        parse_config("sft", base, world_size=2, device="cpu")
    with pytest.raises(ConfigError, match=r"--ds.ring_attn_size 2: must divide the 3 ranks"):
        parse_config("sft", [*base, "--ds.packing_samples", "--train.batch_size", "3"], world_size=3,
                     device="cpu")
    cfg = parse_config("sft", [*base, "--ds.packing_samples"], world_size=2, device="cpu")
    assert cfg.ds.ring_attn_size == 2
    # ppo: every role that loads a model has a multiple of the group size
    ppo = ["--actor.model_name_or_path", "m", "--reward.model_name_or_path", "r",
           "--data.prompt_dataset", "d", "--ds.ring_attn_size", "2", "--ds.packing_samples",
           "--actor.num_gpus_per_node", "2"]
    with pytest.raises(ConfigError, match=r"must divide the 1 rank\(s\) of the reward role"):
        parse_config("ppo", ppo, device="cpu")
    cfg = parse_config("ppo",
                       [*ppo,
                        *[x for role in ("reward", "ref", "critic")
                          for x in (f"--{role}.num_gpus_per_node", "2")]], device="cpu")
    assert cfg.ds.ring_attn_size == 2


def test_ppo_with_ring_attention_turns_packing_on_and_says_so():
    """As OpenRLHF: ppo with --ds.ring_attn_size > 1 and no --ds.packing_samples packs (one warning line, and
    the summary shows why); sft / rm / dpo refuse unpacked rows (OpenRLHF asserts)."""
    from posttrain.config import format_config, resolved_values

    ring = ["--ds.ring_attn_size", "2"]
    for role in ("actor", "ref", "critic"):
        ring += [f"--{role}.num_gpus_per_node", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_config("ppo", BASE["ppo"] + ring, device="cpu")
    assert cfg.ds.packing_samples is True
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert said == ["--ds.packing_samples: False -> True (--ds.ring_attn_size 2 splits packed rows over its "
                    "group)"]
    assert resolved_values(cfg)["ds.packing_samples"][:2] == (False, True)
    assert "packing_samples = True  (asked False; --ds.ring_attn_size 2" in format_config(cfg)
    # asked for: no line
    assert not [w for w in warns("ppo", *ring, "--ds.packing_samples") if "packing" in w]
    for trainer in ("sft", "rm", "dpo"):
        assert problem(trainer, "--ds.ring_attn_size", "2", world_size=2) == (
            "--ds.ring_attn_size 2: needs --ds.packing_samples (each packed row is split over the group)")


def test_ppo_ring_attention_with_images_names_the_ring_flag_not_the_packing_it_turned_on():
    """Ring attention turns packing on in ppo; a vision-language run cannot pack, so the error names the flag
    the user set (--ds.ring_attn_size), not --ds.packing_samples; packing asked for by hand is named so."""
    vlm = ["--ds.ring_attn_size", "2", "--data.max_images_per_prompt", "1", "--algo.advantage.estimator",
           "group_norm", "--rollout.n_samples_per_prompt", "2"]
    for role in ("actor", "ref"):
        vlm += [f"--{role}.num_gpus_per_node", "2"]
    assert problem("ppo", *vlm) == (
        "--ds.ring_attn_size 2: ring attention needs packed rows, which vision-language training cannot use "
        "(--data.max_images_per_prompt > 0); set --ds.ring_attn_size 1")
    assert problem("ppo", *vlm, "--ds.packing_samples") == (
        "--ds.packing_samples: not supported with images (--data.max_images_per_prompt > 0)")


def test_tensor_parallel_rules():
    """--ds.tensor_parallel_size N: N divides the ranks (ppo: of the actor and the critic); not with LoRA,
    4-bit, Muon or (ppo) the EMA; the batch rules count data-parallel ranks (ranks / (TP x
    ring)), not ranks."""
    from posttrain.config import derived_sizes, inert_flags

    tp = ["--ds.tensor_parallel_size", "2"]
    assert problem("sft", *tp, "--train.batch_size", "3", "--train.micro_batch_size", "1", world_size=3) == (
        "--ds.tensor_parallel_size 2: must divide the 3 ranks of the run (groups of 2 consecutive ranks hold "
        "one copy of the model)")
    assert problem("sft", *tp).startswith("--ds.tensor_parallel_size 2: must divide the 1 ranks")
    assert problem("rm", *tp, "--ds.lora.rank", "8", world_size=2).startswith(
        "--ds.tensor_parallel_size 2: not with LoRA (--ds.lora.rank)")
    assert (problems("sft", *tp, "--ds.load_in_4bit", "--ds.lora.rank", "8", world_size=2, device="cuda")[1]
            == "--ds.tensor_parallel_size 2: not with --ds.load_in_4bit: quantized weights cannot be split")
    assert problem("dpo", *tp, "--optim", "muon", world_size=2).startswith(
        "--ds.tensor_parallel_size 2: not with --optim muon")
    # tensor and context parallel together: 4 ranks are one data-parallel index
    ring = parse_config("sft", [*BASE["sft"], *tp, "--ds.ring_attn_size", "2", "--ds.packing_samples",
                                "--train.batch_size", "4", "--train.micro_batch_size", "4"], world_size=4,
                        device="cpu")
    assert derived_sizes(ring, 4)["data_parallel_size"] == 1
    # 4 ranks in 2 groups: a step of 8 samples is 2 x micro-batch 4 (the world size alone would need 16)
    cfg = parse_config("sft", [*BASE["sft"], *tp, "--train.batch_size", "8", "--train.micro_batch_size", "4"],
                       world_size=4, device="cpu")
    sizes = derived_sizes(cfg, 4)
    assert (sizes["world_size"], sizes["data_parallel_size"], sizes["samples_per_rank_per_step"]) == (4, 2, 4)
    assert ("data-parallel size (ranks / (--ds.tensor_parallel_size x --ds.ring_attn_size)) = 4 x 2 = 8"
            in problem("sft", *tp, "--train.batch_size", "4", "--train.micro_batch_size", "4", world_size=4))
    ppo = parse_config("ppo", [*BASE["ppo"], *tp], check=False)
    assert [n for n in inert_flags(ppo, "cpu") if n.startswith("--ds.tensor_parallel_size")] == []
    assert problems("ppo", *tp)[0].startswith("--ds.tensor_parallel_size 2: must divide the 1 rank(s) of the "
                                              "actor role")
    assert ("--ds.tensor_parallel_size 2: not with --train.enable_ema: the EMA would be kept per shard"
            in problems("ppo", *tp, "--actor.num_gpus_per_node", "2", "--train.enable_ema"))
