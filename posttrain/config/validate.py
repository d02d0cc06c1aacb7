"""`validate(cfg, world_size, device)`: every flag's own declared facts (choices, range, required;
`posttrain.config.spec.opt`) and the rules that relate several flags, checked once before any model
loads.

All problems are collected and raised together as one ConfigError (each names the flag(s), the value
and what would be valid). Allowed-but-suspicious settings are returned as warning strings."""

from __future__ import annotations

import copy
import math
from typing import Any

from posttrain.config.backends import rollout_backend
from posttrain.config.errors import ConfigError
from posttrain.config.facts import deepspeed_only_flags
from posttrain.config.flag_values import check_flag_choice, parse_probs
from posttrain.config.hardware import device_type, record_resolved, resolved_values
from posttrain.config.inference import INFERENCE_CONFIGS
from posttrain.config.placement_plan import PlacementError, plan_of
from posttrain.config.ppo_rules import ppo_rules
from posttrain.config.ray_mode import critic_path, role_ranks, run_roles
from posttrain.config.roles import DPO_LOSS_PARAMS
from posttrain.config.rule_report import RuleReport
from posttrain.config.sections import POLYNOMIAL_LR_END, DSConfig, OptimizerFields
from posttrain.config.serving import ServedModelConfig, ServeRMConfig
from posttrain.config.spec import flag_specs, get_path, set_path
from posttrain.config.summary import data_parallel_size, micro_batch_tokens
from posttrain.config.trainers import (
    TRAINERS,
    CommandConfig,
    DPOConfig,
    KTOConfig,
    PPOConfig,
    PRMConfig,
    RMConfig,
    TrainerConfig,
)
from posttrain.utils.extras import installed, missing_message


def validate(cfg: CommandConfig, world_size: int = 1, device: Any = None) -> list[str]:
    """Check `cfg` for `world_size` data-parallel ranks on `device` ("cpu" / "cuda"; default: what torch
    sees). Raises ConfigError listing every problem; returns warnings (strings) otherwise. Resolves
    the auto value of `--actor.loss_agg` (PPO) and, with ring attention, `--ds.packing_samples` on (PPO) on
    `cfg`, recorded like the hardware defaults."""
    if cfg.trainer == "ppo" and world_size > 1:
        raise ConfigError(f"posttrain ppo is one controller process that places its roles on Ray itself "
                          f"(WORLD_SIZE={world_size}): launch it once, as `posttrain ppo ...` or `python -m "
                          "posttrain.cli.train_ppo_ray ...`, with --actor.num_gpus_per_node / "
                          "--vllm.num_engines for more ranks, not under torchrun or deepspeed")
    r = RuleReport()
    dev = device_type(device)
    if cfg.trainer == "serve-rm":
        _declared(cfg, r)
        _served_source(cfg, r)
        if r.problems:
            raise ConfigError.collect(r.problems)
        return r.warnings
    if cfg.trainer in INFERENCE_CONFIGS:
        _declared(cfg, r)
        _inference(cfg, r)
        if r.problems:
            raise ConfigError.collect(r.problems)
        return r.warnings
    r.need(
        world_size >= 1,
        "train.batch_size",
        cfg.train.batch_size,
        f"world size must be >= 1, got {world_size}",
    )
    broken = _declared(cfg, r)
    if broken:  # the rules below read each flag within its declared range (no division by a size of 0)
        cfg = copy.deepcopy(cfg)
        for spec in broken:
            set_path(cfg, spec.path, copy.deepcopy(spec.default))
    _engine(cfg, r, dev)
    _data(cfg, r)
    _train(cfg, r, world_size)
    _ckpt(cfg, r)
    if cfg.trainer in TRAINERS:
        _context_parallel(cfg, r, world_size)
        _tensor_parallel(cfg, r, world_size, dev)
    if cfg.trainer == "ppo":
        ppo_rules(cfg, r, world_size)
        _vision_rl(cfg, r)
        _vllm_tensor_parallel(cfg, r, dev)
        _placement(cfg, r)
        for role in ("actor", "critic"):
            _optimizer(getattr(cfg, role), f"{role}.", cfg, r)
    else:
        _optimizer(cfg, "", cfg, r)
    if cfg.trainer == "dpo":
        _dpo(cfg, r)
    if cfg.trainer == "rm":
        _rm(cfg, r)
    if cfg.trainer == "kto":
        _kto(cfg, r)
    if cfg.trainer == "prm":
        _prm(cfg, r)
    _optional_parts(cfg, r, world_size)
    if r.problems:
        raise ConfigError.collect(r.problems)
    return r.warnings


def _optional_parts(cfg: TrainerConfig, r: RuleReport, world_size: int) -> None:
    """What the run asked for that needs an optional dependency which is not installed (`utils.extras`):
    Ray for a run on Ray, DeepSpeed for ZeRO (several ranks, a DeepSpeed-only flag), TensorBoard, W&B.
    (bitsandbytes is checked where the 4-bit base loads, on a CUDA GPU only.)"""
    needs = []
    if cfg.trainer == "ppo":
        roles = run_roles(cfg)
        needs += [(roles.ray_reason, "ray"), (roles.several_ranks, "deepspeed")]
    else:
        ranks = f"training on {world_size} ranks (WORLD_SIZE={world_size})" if world_size > 1 else None
        needs += [(ranks or ", ".join(deepspeed_only_flags(cfg.ds)), "deepspeed")]
    needs += [(cfg.logger.tensorboard_dir and "--logger.tensorboard_dir", "tensorboard"),
              (cfg.logger.wandb.key is not None and "--logger.wandb.key", "wandb")]
    r.problems += [missing_message(module, what) for what, module in needs if what and not installed(module)]


def check_serving_model(ds: ServedModelConfig, device: Any = None) -> list[str]:
    """The model-loading rules of `--ds.*` for a model that is only run, never trained (serve-rm):
    raises ConfigError (e.g. 4-bit on a CPU), returns warnings (e.g. bf16 on a CPU)."""
    r = RuleReport()
    _model_loading(ds, r, device_type(device))
    if r.problems:
        raise ConfigError.collect(r.problems)
    return r.warnings


def _declared(cfg: CommandConfig, r: RuleReport) -> list:
    """Each flag's own facts: its choices (per element of a list), its range or check, required. Returns the
    specs of the flags that break theirs."""
    broken = []
    for spec in flag_specs(type(cfg)):
        value = get_path(cfg, spec.path)
        before = len(r.problems)
        for v in value if spec.is_list and value is not None else [value]:
            try:
                check_flag_choice(spec, v)
            except ValueError as e:
                r.bad(spec.path, v, str(e))
        problem = spec.problem(value)
        if problem:
            r.bad(spec.path, None if problem.startswith("required: ") else value, problem)
        if len(r.problems) > before:
            broken.append(spec)
    return broken


def _context_parallel(cfg, r: RuleReport, world_size: int) -> None:
    """--ds.ring_attn_size N: every packed row split over N ranks; N divides the ranks (of the run, or of each
    role of ppo that loads a model), rows are packed: sft / rm / dpo refuse unpacked rows, ppo turns
    --ds.packing_samples on with a warning (both as OpenRLHF)."""
    n = cfg.ds.ring_attn_size
    if n == 1:
        return
    if not cfg.ds.packing_samples and cfg.trainer == "ppo":
        r.warnings.append(record_resolved(cfg, "ds.packing_samples", True,
                                          f"--ds.ring_attn_size {n} splits packed rows over its group"))
    elif not cfg.ds.packing_samples:
        r.bad("ds.ring_attn_size", n, "needs --ds.packing_samples (each packed row is split over the group)")
    if cfg.trainer != "ppo":
        if world_size % n:
            r.bad("ds.ring_attn_size", n, f"must divide the {world_size} ranks of the run (groups of {n} "
                  "ranks share each row)")
        return
    for role, section in run_roles(cfg).sections.items():
        ranks = role_ranks(section)
        if ranks % n or ranks == 1:
            r.bad("ds.ring_attn_size", n, f"must divide the {ranks} rank(s) of the {role} role (groups of "
                  f"{n} ranks share each row; set --{role}.num_gpus_per_node to a multiple of {n})")


def _tensor_parallel(cfg, r: RuleReport, world_size: int, dev: str) -> None:
    """--ds.tensor_parallel_size N: the model split over groups of N ranks; N divides the ranks (of the
    run, or of each trained ppo role: the actor and a critic); not with what changes the split layers (LoRA
    adapters, 4-bit weights), Muon (it orthogonalizes whole matrices), ring attention (one kind of group at
    a time) or the actor's EMA (kept per shard). The heads are checked against N where the model's config
    is read (`models.config_facts.check_tensor_parallel_config`, on the models of `tensor_parallel_split`)."""
    n, ds = cfg.ds.tensor_parallel_size, cfg.ds
    if n == 1:
        return
    flag = "ds.tensor_parallel_size"
    fp32 = (ds.param_dtype or ("bf16" if dev == "cuda" else "fp32")) == "fp32"
    if cfg.trainer == "ppo":
        roles = run_roles(cfg).sections
        for role in ("actor", "critic"):
            section = roles.get(role)
            if section is not None and (role_ranks(section) % n or role_ranks(section) == 1):
                r.bad(flag, n, f"must divide the {role_ranks(section)} rank(s) of the {role} role (groups of "
                      f"{n} ranks hold one copy of its model; set --{role}.num_gpus_per_node to a multiple "
                      f"of {n})")
        if cfg.train.enable_ema:
            r.bad(flag, n, "not with --train.enable_ema: the EMA would be kept per shard")
        optims = {cfg.actor.optim, cfg.critic.optim}
    else:
        if world_size % n:
            r.bad(flag, n, f"must divide the {world_size} ranks of the run (groups of {n} consecutive ranks "
                  "hold one copy of the model)")
        elif world_size == n and ds.zero_stage in (1, 2) and fp32:
            r.warnings.append(
                f"--ds.tensor_parallel_size {n} on {world_size} ranks leaves ZeRO-{ds.zero_stage} nothing to "
                "partition (one data-parallel replica); in fp32 it only adds DeepSpeed's master copy of the "
                "weights and a flat gradient (measured 0.81x one process's parameter + optimizer memory per "
                "rank vs 0.54x): --ds.zero_stage 0 trains the same")
        optims = {cfg.optim}
    if ds.lora.rank > 0:
        r.bad(flag, n, "not with LoRA (--ds.lora.rank): the adapters would wrap the split layers; this "
              "version splits plain linear layers only")
    if ds.load_in_4bit:
        r.bad(flag, n, "not with --ds.load_in_4bit: quantized weights cannot be split")
    if "muon" in optims:
        r.bad(flag, n, "not with --optim muon: Muon orthogonalizes whole matrices, a rank holds a slice")


def tensor_parallel_split(cfg: TrainerConfig) -> tuple[int, list[str]]:
    """(N, the paths of the models split over groups of N ranks) for --ds.tensor_parallel_size N: sft / rm /
    dpo's model; ppo's actor and, with a critic, the critic's starting weights; (N, []) when N is 1."""
    n = cfg.ds.tensor_parallel_size
    if n <= 1:
        return n, []
    if cfg.trainer != "ppo":
        return n, [cfg.model.model_name_or_path]
    return n, [cfg.actor.model_name_or_path] + ([critic_path(cfg)] if run_roles(cfg).has("critic") else [])


def tensor_parallel_refusal(size: int | None, why: str) -> str:
    """The one line refusing --ds.tensor_parallel_size `size` (None: the flag alone) for `why`, for what is
    checked where the model is read (`models.config_facts`, `models.tensor_parallel`)."""
    flag = "--ds.tensor_parallel_size"
    return f"{flag}: {why}" if size is None else f"{flag} {size}: {why}"


LOSS_NAMES = {"sigmoid": "DPO", "ipo": "IPO", "orpo": "ORPO", "simpo": "SimPO", "cpo": "CPO"}
# what a DPO-family parameter is, and (param, loss) -> where that loss's own knob is, for the refusals
_PARAM_OWNERS = {"beta": "the reward scale of sigmoid / ipo / simpo / cpo", "label_smoothing": "cDPO's",
                 "nll_loss_coef": "the NLL weight of sigmoid / ipo / simpo", "orpo_lambda": "ORPO's",
                 "simpo_gamma": "SimPO's", "cpo_alpha": "CPO's"}
_OWN_KNOB = {("beta", "orpo"): " (its weight is --model.orpo_lambda)",
             ("nll_loss_coef", "orpo"): " (its NLL weight is 1)",
             ("nll_loss_coef", "cpo"): " (its NLL weight is --model.cpo_alpha)"}


def _dpo(cfg: DPOConfig, r: RuleReport) -> None:
    """A DPO-family parameter set away from its default with a loss that does not read it
    (`roles.DPO_LOSS_PARAMS`), and --model.ipo_enable with another --model.loss_type than ipo, are refused
    rather than ignored."""
    m = cfg.model
    if m.ipo_enable and m.loss_type not in ("sigmoid", "ipo"):
        r.problems.append(f"--model.ipo_enable selects IPO; --model.loss_type {m.loss_type} selects "
                          f"{LOSS_NAMES[m.loss_type]}. Drop one of the two flags.")
        return
    loss = m.preference_loss()
    named = "IPO (--model.ipo_enable)" if m.ipo_enable else f"{LOSS_NAMES[loss]} (--model.loss_type {loss})"
    defaults = type(m)()
    for name, readers in DPO_LOSS_PARAMS.items():
        value = getattr(m, name)
        if loss not in readers and value != getattr(defaults, name):
            r.problems.append(f"--model.{name} {value} is {_PARAM_OWNERS[name]}; {named} does not use it"
                              f"{_OWN_KNOB.get((name, loss), '')}. Drop one of the two flags.")


def _kto(cfg: KTOConfig, r: RuleReport) -> None:
    """KTO's KL estimate pairs each row of a step with another row's completion: one row has none."""
    if cfg.model.loss_type == "kto" and cfg.train.batch_size < 2:
        r.bad("train.batch_size", cfg.train.batch_size,
              "KTO estimates its KL term from each row's prompt with another row's completion of the same "
              "step, so a step needs at least 2 rows; raise it, or use --model.loss_type apo_zero_unpaired")


def _prm(cfg: PRMConfig, r: RuleReport) -> None:
    """The placeholder is not a label token; each row's placeholders are read whole (no ring attention)."""
    m = cfg.model
    if m.placeholder_token and m.placeholder_token in (m.reward_tokens or ()):
        r.bad("model.placeholder_token", m.placeholder_token, "is one of --model.reward_tokens; the token "
              "that ends a step must differ from the label tokens that follow it")
    if cfg.ds.ring_attn_size > 1:
        r.bad("ds.ring_attn_size", cfg.ds.ring_attn_size, "posttrain prm reads the logits at every "
              "placeholder of a row, which ring attention splits over ranks; leave it at 1")


def _rm(cfg: RMConfig, r: RuleReport) -> None:
    """A margin is a term of the sigmoid loss only; reward models read text only (a score model has no
    vision-language form for most families, and the scorers of ppo and serve-rm score text)."""
    m = cfg.model
    if m.margin_loss_enable and m.loss_type != "sigmoid":
        r.problems.append(f"--model.margin_loss_enable needs --model.loss_type sigmoid, got {m.loss_type!r}: "
                          "the logexp loss has no margin term. Drop one of the two flags.")
    defaults = type(cfg.data)()
    for name in ("max_images_per_prompt", "image_key"):
        value = getattr(cfg.data, name)
        if value != getattr(defaults, name):
            r.problems.append(f"--data.{name} {value}: posttrain rm trains text-only reward models (a "
                              "score model has no vision-language form here, and ppo / serve-rm score text); "
                              "drop the flag")


def _placement(cfg: PPOConfig, r: RuleReport) -> None:
    """A run on Ray: the colocation flags' role sizes fit together (`placement_plan.plan_of`, OpenRLHF's
    asserts), refused here rather than when the run places its roles, after its data and models load."""
    if run_roles(cfg).on_ray:
        try:
            plan_of(cfg)
        except PlacementError as e:
            r.problems.append(str(e))


def _vllm_tensor_parallel(cfg: PPOConfig, r: RuleReport, dev: str) -> None:
    problem = vllm_tensor_parallel_problem(cfg, dev)
    if problem:
        r.problems.append(problem)


def vllm_tensor_parallel_problem(cfg: PPOConfig, dev: str) -> str | None:
    """--vllm.tensor_parallel_size > 1 runs on CPUs only (vLLM's `mp` executor in the engine's process):
    where the run's engines are vLLM engines (`backends.rollout_backend`) on a CUDA machine it is refused,
    at start-up before Ray places anything (each engine's Ray process is given one GPU), and again by the
    engine's worker (a cluster whose head has no GPU but whose workers do)."""
    tp = cfg.vllm.tensor_parallel_size
    if tp <= 1 or dev != "cuda":
        return None
    try:
        backend = rollout_backend(cfg)[0]
    except ConfigError:  # --rollout.engine vllm where vLLM cannot run: the engine's worker names why
        return None
    if backend != "vllm":
        return None
    return (f"--vllm.tensor_parallel_size {tp}: a vLLM engine with tensor parallelism runs on CPUs "
            "(vLLM's CPU build) in this version, not on GPUs (its Ray process is given one GPU); use "
            "--vllm.tensor_parallel_size 1 and more --vllm.num_engines")


def _inference(cfg, r: RuleReport) -> None:
    """chat / generate / eval: at most one reward source; --post_processor needs one (iter_dpo: two samples
    per prompt)."""
    reward = getattr(cfg, "reward", None)
    if reward is not None and reward.remote_url and reward.model_name_or_path:
        r.problems.append("--reward.remote_url and --reward.model_name_or_path both given: samples are "
                          "scored by one source, drop one")
    if cfg.trainer != "generate":
        return
    has_reward = bool(reward.remote_url or reward.model_name_or_path)
    post = cfg.post_processor
    r.need(has_reward or not post, "post_processor", post, "needs a reward to rank the samples: "
           "--reward.remote_url (a reward_func .py file or a server URL) or --reward.model_name_or_path")
    n = cfg.rollout.n_samples_per_prompt
    r.need(post != "iter_dpo" or n >= 2, "post_processor", post,
           f"needs two samples per prompt or more (--rollout.n_samples_per_prompt {n})")


def _served_source(cfg: ServeRMConfig, r: RuleReport) -> None:
    """serve-rm serves exactly one source: a reward model or a reward_func .py file."""
    model, url = cfg.reward.model_name_or_path, cfg.reward.remote_url
    if bool(model) == bool(url):
        r.problems.append("give exactly one of --reward.model_name_or_path DIR or --reward.remote_url "
                          "FILE.py")
    elif url and not url.endswith(".py"):
        r.problems.append(f"--reward.remote_url={url!r}: serve-rm serves a .py reward function file")


def _engine(cfg: TrainerConfig, r: RuleReport, dev: str) -> None:
    ds = cfg.ds
    if ds.tensor_parallel_size > 1 and ds.zero_stage == 3:
        r.bad(
            "ds.tensor_parallel_size",
            ds.tensor_parallel_size,
            "AutoTP works only with --ds.zero_stage 0, 1 or 2",
        )
    lora = ds.lora
    if lora.rank > 0 and not lora.target_modules:
        r.bad(
            "ds.lora.target_modules",
            lora.target_modules,
            "give module names (e.g. q_proj v_proj) or all-linear",
        )
    if ds.load_in_4bit and lora.rank <= 0:
        r.bad("ds.load_in_4bit", True,
              "4-bit weights cannot be trained; use it with LoRA (--ds.lora.rank > 0)")
    _model_loading(ds, r, dev)


def _model_loading(ds: DSConfig | ServedModelConfig, r: RuleReport, dev: str) -> None:
    """Loading rules shared by trained and served models: 4-bit needs CUDA; bf16 / fp16 on a CPU are slow."""
    if ds.load_in_4bit and dev != "cuda":
        r.bad("ds.load_in_4bit", True, "bitsandbytes 4-bit loading needs a CUDA GPU; this run is on CPU")
    if dev == "cpu" and ds.param_dtype == "bf16":
        r.warnings.append(
            "--ds.param_dtype bf16 on CPU: bf16 matmuls are ~140x slower than fp32 on this CPU; "
            "leave --ds.param_dtype unset (auto: fp32 on CPU) unless you need bf16"
        )
    if dev == "cpu" and ds.param_dtype == "fp16":
        r.warnings.append("--ds.param_dtype fp16 on CPU is slow and numerically fragile; prefer fp32")


def _data(cfg: TrainerConfig, r: RuleReport) -> None:
    d = cfg.data
    if d.input_template is not None and "{}" in d.input_template and "\\n" in d.input_template:
        r.warnings.append(
            "--data.input_template contains a literal backslash-n, not a newline; "
            "in bash write $'User: {}\\nAssistant: '"
        )
    src, probs = ("prompt_dataset", "prompt_probs") if cfg.trainer == "ppo" else ("dataset", "dataset_probs")
    dataset = getattr(d, src)
    _probs(r, f"data.{probs}", getattr(d, probs), dataset, f"data.{src}")
    if getattr(d, "multiturn", False) and not d.apply_chat_template:
        r.bad(
            "data.multiturn",
            True,
            "needs --data.apply_chat_template (turns are found through the chat template)",
        )


def _probs(r: RuleReport, flag: str, text: str | None, datasets: str | None, src_flag: str) -> None:
    try:
        probs = parse_probs(text)
    except ValueError:
        r.bad(flag, text, "expected comma-separated numbers, e.g. 0.3,0.7")
        return
    if probs is None:
        return
    n = len(str(datasets).split(",")) if datasets else 0
    if datasets and len(probs) != n:
        r.bad(flag, text, f"{len(probs)} probabilities for {n} datasets in --{src_flag}")
    if any(p < 0 for p in probs):
        r.bad(flag, text, "probabilities must be >= 0")
    elif not math.isclose(sum(probs), 1.0, abs_tol=1e-3):
        r.bad(flag, text, f"probabilities must sum to 1 (they sum to {sum(probs):g})")


def _train(cfg: TrainerConfig, r: RuleReport, world_size: int) -> None:
    t = cfg.train
    dp = data_parallel_size(cfg, world_size)
    ranks = "world size" if dp == world_size else ("data-parallel size (ranks / (--ds.tensor_parallel_size x "
                                                   "--ds.ring_attn_size))")
    if t.dynamic_batch_enable:
        if t.max_tokens_per_gpu is None or t.max_tokens_per_gpu <= 0:
            r.bad(
                "train.dynamic_batch_enable", True, "needs --train.max_tokens_per_gpu > 0 (the token budget)"
            )
        elif micro_batch_tokens(cfg, t.max_tokens_per_gpu) < cfg.data.max_len:
            group = micro_batch_tokens(cfg, 1)
            gpus = f" x {group} GPUs (ring-attention x tensor-parallel group)" if group > 1 else ""
            r.warnings.append(
                f"--train.max_tokens_per_gpu {t.max_tokens_per_gpu}{gpus} < --data.max_len "
                f"{cfg.data.max_len}: a longest sample gets a micro-batch of its own"
            )
        if t.batch_size % max(dp, 1):
            r.bad("train.batch_size", t.batch_size, f"must be divisible by the {ranks} {dp}")
    elif t.batch_size >= 1 and t.micro_batch_size >= 1 and world_size >= 1:
        step = t.micro_batch_size * dp
        if t.batch_size % step:
            r.bad(
                "train.batch_size",
                t.batch_size,
                f"must be divisible by --train.micro_batch_size x {ranks} = {t.micro_batch_size} x "
                f"{dp} = {step} (e.g. {max(step, t.batch_size // step * step)})",
            )


def _ckpt(cfg: TrainerConfig, r: RuleReport) -> None:
    c = cfg.ckpt
    if c.load_enable and c.path == "":  # unset (None): <--ckpt.output_dir>/checkpoints (checkpoint_dir)
        r.bad("ckpt.load_enable", True, "needs --ckpt.path (where the checkpoints are)")


def _optimizer(o: OptimizerFields, prefix: str, cfg: TrainerConfig, r: RuleReport) -> None:
    if o.lr_scheduler == "polynomial" and not o.adam.lr > POLYNOMIAL_LR_END:
        r.bad(prefix + "adam.lr", o.adam.lr, f"--{prefix}lr_scheduler polynomial decays to the learning rate "
              f"{POLYNOMIAL_LR_END:g} (transformers' lr_end), so it must start above that; raise it or use "
              "linear")
    if o.optim == "muon" and cfg.ds.adam_offload:
        r.bad(
            prefix + "optim",
            "muon",
            "Muon keeps its state on the accelerator: not compatible with "
            "--ds.adam_offload; use --optim adam or drop --ds.adam_offload",
        )


def _vision_rl(cfg: PPOConfig, r: RuleReport) -> None:
    """Vision-language RL: no critic, no packed rows."""
    adv = cfg.algo.advantage
    if cfg.data.max_images_per_prompt > 0:
        if adv.estimator == "gae":
            r.bad(
                "data.max_images_per_prompt",
                cfg.data.max_images_per_prompt,
                "vision-language training has no critic: use an estimator other than gae",
            )
        if cfg.ds.packing_samples and resolved_values(cfg).get("ds.packing_samples", (True,))[0] is False:
            r.bad("ds.ring_attn_size", cfg.ds.ring_attn_size, "ring attention needs packed rows, which "
                  "vision-language training cannot use (--data.max_images_per_prompt > 0); set "
                  "--ds.ring_attn_size 1")
        elif cfg.ds.packing_samples:
            r.bad("ds.packing_samples", True, "not supported with images (--data.max_images_per_prompt > 0)")
