"""The rules between `posttrain ppo`'s flags (`ppo_rules`, called by `config.validate.validate`): the loss
aggregation, the reward sources and their weights, the rollout engines and sizes, advantages and KL, async
and EMA (vision RL's rules stay in `config.validate`, beside the image limit's other rules)."""
from __future__ import annotations

from posttrain.config.flag_values import format_value
from posttrain.config.hardware import record_resolved, resolved_values
from posttrain.config.ray_mode import role_ranks, uses_ray
from posttrain.config.roles import (
    GROUP_ESTIMATORS,
    RESERVED_TERM_NAMES,
    SEQUENCE_POLICY_LOSSES,
    reward_endpoints,
    reward_func_spec,
)
from posttrain.config.rule_report import RuleReport, check_pair
from posttrain.config.trainers import PPOConfig


def _loss_agg(cfg: PPOConfig, r: RuleReport) -> None:
    """`--actor.loss_agg` unset (auto) resolves to seq_mean_token_mean for a sequence-ratio policy loss
    (`--actor.policy_loss_type gspo`: OpenRLHF's GSPO loss is a per-sequence mean of token means; `seq_sum`:
    TRL RLOO's mean over sequences) and to token_mean otherwise, recorded like a hardware default
    (`format_config` shows why). token_mean asked for with either is refused."""
    a = cfg.actor
    asked = resolved_values(cfg).get("actor.loss_agg", (a.loss_agg,))[0]
    per_sequence = a.policy_loss_type in SEQUENCE_POLICY_LOSSES
    if asked is None:
        auto = "seq_mean_token_mean" if per_sequence else "token_mean"
        why = f"auto for --actor.policy_loss_type {a.policy_loss_type}"
        record_resolved(cfg, "actor.loss_agg", auto, why)
    elif asked == "token_mean" and per_sequence:
        names = {"gspo": ("GSPO", "as OpenRLHF"), "seq_sum": ("seq_sum", "as TRL RLOO")}
        name, source = names[a.policy_loss_type]
        r.bad(
            "actor.loss_agg",
            asked,
            f"{name}'s importance ratio is per sequence, and a token mean would weight each sequence by its "
            f"length; leave --actor.loss_agg unset (auto: seq_mean_token_mean, {source})",
        )


def ppo_rules(cfg: PPOConfig, r: RuleReport, world_size: int) -> None:
    """The rules of `posttrain ppo`, by subject (problems are reported in this order)."""
    _reward_source(cfg, r)
    _rollout_engines(cfg, r)
    _loss_agg(cfg, r)
    _rollout_sizes(cfg, r)
    _advantage_and_kl(cfg, r)
    _async_and_ema(cfg, r)


def _reward_source(cfg: PPOConfig, r: RuleReport) -> None:
    """A reward source: a reward model or a remote URL (or .py file), not both, with or beside reward
    function files (--reward.func_path, one finite weight each); or an agent file; or a teacher alone
    (--algo.teacher_coef only with one). A tool file (scored by
    the reward source) with the chat template and without an agent file."""
    rw, t = cfg.reward, cfg.train
    if rw.func_path is not None:
        r.problems.extend(_reward_term_problems(rw.func_path, rw.func_weights))
    if rw.model_name_or_path and rw.remote_url:
        r.problems.append(
            f"--reward.model_name_or_path {format_value(rw.model_name_or_path)} and --reward.remote_url "
            f"{format_value(rw.remote_url)}: a run takes its rewards from one source; drop one"
        )
    elif rw.remote_url:
        try:
            reward_endpoints(rw.remote_url)
        except ValueError as err:
            r.bad("reward.remote_url", rw.remote_url, str(err))
    elif not (rw.model_name_or_path or rw.remote_url or rw.func_path or t.agent_func_path
              or cfg.teacher.model_name_or_path):
        r.bad(
            "reward.model_name_or_path",
            None,
            "a reward source is required: --reward.model_name_or_path (a reward model), "
            "--reward.remote_url (an http(s) reward server or a .py file defining reward_func), "
            "--reward.func_path (reward function files), "
            "--train.agent_func_path (an agent file whose environment returns rewards) or "
            "--teacher.model_name_or_path (on-policy distillation: the teacher's per-token reward alone)",
        )
    scored_elsewhere = rw.remote_url or rw.func_path or t.agent_func_path
    task_reward = rw.model_name_or_path or scored_elsewhere
    sequence_reward = (rw.model_name_or_path and not rw.prm) or scored_elsewhere  # a PRM scores steps only
    if cfg.eval.dataset and not sequence_reward:
        r.warnings.append(
            f"--eval.dataset {format_value(cfg.eval.dataset)}: this run has no task reward (its only rewards "
            "are per-token terms: the teacher's or the PRM's), so every evaluation reward and pass rate "
            "reads 0 and no best model is selected; add --reward.remote_url or --reward.func_path to "
            "measure the task")
    if cfg.teacher.model_name_or_path and not task_reward and cfg.algo.dynamic_filtering_enable:
        r.bad("algo.dynamic_filtering_enable", True, "filters groups by their task rewards, and this run's "
              "only reward is the teacher's per-token term (every score 0: every group would be dropped); "
              "drop the flag or add a reward source")
    _process_reward_model(cfg, r)
    if cfg.algo.teacher_coef is not None and not cfg.teacher.model_name_or_path:
        r.bad("algo.teacher_coef", cfg.algo.teacher_coef, "weighs the on-policy distillation term, which "
              "needs a teacher: add --teacher.model_name_or_path (or drop the flag)")
    if t.tool_path and t.agent_func_path:
        r.bad("train.tool_path", t.tool_path, f"refused together with --train.agent_func_path "
              f"{format_value(t.agent_func_path)}: a run has one environment; drop one")
    elif t.tool_path and not cfg.data.apply_chat_template:
        r.bad("train.tool_path", t.tool_path, "needs --data.apply_chat_template (the prompts are rendered "
              "with the tools' schemas)")


def _process_reward_model(cfg: PPOConfig, r: RuleReport) -> None:
    """--reward.prm: the PRM is --reward.model_name_or_path (not a server: a server returns one number per
    sequence), scores single-turn responses, and alone (without --reward.func_path) gives every sequence the
    score 0, which dynamic filtering cannot filter on. (prm.json and the one-token checks need the model
    folder and its tokenizer: `trainers.rl.build.check_prm`, before any model loads.)"""
    rw, t = cfg.reward, cfg.train
    if not rw.prm:
        return
    if rw.remote_url:
        r.bad("reward.prm", True, f"refused with --reward.remote_url {format_value(rw.remote_url)}: a reward "
              "server returns one score per sequence, a PRM scores each step; give the PRM as "
              "--reward.model_name_or_path")
    elif not rw.model_name_or_path:
        r.bad("reward.prm", True, "needs --reward.model_name_or_path (the process reward model's folder)")
    if rw.normalize_enable:
        r.bad("reward.normalize_enable", True, "normalises a scalar reward model's scores with the mean/std "
              "in its config; a PRM's step scores are probabilities (--reward.prm): drop the flag")
    if t.agent_func_path or t.tool_path:
        flag = "--train.agent_func_path" if t.agent_func_path else "--train.tool_path"
        r.bad("reward.prm", True, f"scores the steps of single-turn responses; refused with {flag} (an "
              "episode's environment tokens are no steps of the policy's)")
    if not rw.func_path and cfg.algo.dynamic_filtering_enable:
        r.bad("algo.dynamic_filtering_enable", True, "filters groups by their sequence rewards, and a PRM "
              "alone gives every sequence 0 (its step scores are token rewards): add --reward.func_path or "
              "drop the flag")


def _reward_term_problems(func_path: list[str], func_weights: list[float] | None) -> list[str]:
    """What is wrong with `--reward.func_path` / `--reward.func_weights` (one line each, [] when nothing):
    each entry a .py file (`reward_func_spec`), term names unique and none of RESERVED_TERM_NAMES, one
    finite weight per file."""
    problems, seen = [], {}
    for i, entry in enumerate(func_path, 1):
        try:
            name = reward_func_spec(entry)[2]
        except ValueError as err:
            problems.append(f"--reward.func_path entry {i} ({entry!r}): {err}")
            continue
        if name in RESERVED_TERM_NAMES:
            problems.append(f"--reward.func_path entry {i} ({entry!r}): its term name {name!r} is reserved "
                            f"(reward/{name} is another metric); rename the file or give FILE.py:FUNCTION")
        elif name in seen:
            problems.append(f"--reward.func_path entries {seen[name]} and {i} are both named {name!r} "
                            "(reward/<name>); rename a file or give FILE.py:FUNCTION")
        seen.setdefault(name, i)
    if func_weights is not None and len(func_weights) != len(func_path):
        problems.append(f"--reward.func_weights has {len(func_weights)} weights for {len(func_path)} "
                        "--reward.func_path files; give one weight per file (or none: 1 each)")
    return problems


def _rollout_engines(cfg: PPOConfig, r: RuleReport) -> None:
    """What the rollout engines can run: a QLoRA actor only in one process, vLLM only in engines of
    its own."""
    t = cfg.train
    if cfg.ds.load_in_4bit and cfg.ds.lora.rank > 0 and (t.async_enable or uses_ray(cfg)):
        r.bad("ds.load_in_4bit", True, "a QLoRA actor cannot sync its weights to rollout engines of their "
              "own yet (Ray, --vllm.num_engines, --train.async_enable): run in one process, where the engine "
              "samples from the actor itself")
    if cfg.rollout.engine == "vllm" and not (cfg.vllm.num_engines or 0) >= 1:
        r.bad("rollout.engine", "vllm", "vLLM runs in rollout engines of their own: add --vllm.num_engines 1 "
              "(on Ray); one process samples with the HF engine over the actor's module")


def _rollout_sizes(cfg: PPOConfig, r: RuleReport) -> None:
    """Generation budget and batch sizes of a rollout."""
    ro, t = cfg.rollout, cfg.train
    if ro.max_new_tokens is not None:
        r.need(
            0 < ro.max_new_tokens < cfg.data.max_len,
            "rollout.max_new_tokens",
            ro.max_new_tokens,
            f"must be in [1, --data.max_len {cfg.data.max_len}) to leave room for the prompt",
        )
    samples = ro.batch_size * ro.n_samples_per_prompt
    if samples >= 1 and t.batch_size >= 1 and samples % t.batch_size:
        r.bad(
            "train.batch_size",
            t.batch_size,
            f"must divide the samples per rollout --rollout.batch_size x --rollout.n_samples_per_prompt = "
            f"{ro.batch_size} x {ro.n_samples_per_prompt} = {samples}",
        )
    gen = ro.vllm_generate_batch_size
    if gen is not None and gen > ro.batch_size and not t.async_enable:
        r.bad(
            "rollout.vllm_generate_batch_size",
            ro.vllm_generate_batch_size,
            f"larger than --rollout.batch_size {ro.batch_size} needs --train.async_enable (oversampling)",
        )


def _advantage_and_kl(cfg: PPOConfig, r: RuleReport) -> None:
    """Estimators, KL, dynamic filtering and reward shaping."""
    algo, ro, rw = cfg.algo, cfg.rollout, cfg.reward
    adv, kl = algo.advantage, algo.kl
    # estimators
    if adv.estimator in GROUP_ESTIMATORS and ro.n_samples_per_prompt < 2:
        r.bad(
            "algo.advantage.estimator",
            adv.estimator,
            f"a group estimator needs --rollout.n_samples_per_prompt >= 2 (got {ro.n_samples_per_prompt})",
        )
    if adv.estimator in GROUP_ESTIMATORS and adv.gamma != 1.0:
        r.warnings.append(
            f"--algo.advantage.gamma {adv.gamma} is ignored by {adv.estimator} (uses gamma = 1)"
        )
    # KL
    if kl.use_loss and kl.estimator == "k1":
        r.warnings.append(
            "--algo.kl.use_loss with --algo.kl.estimator k1: k1's gradient is not the KL's; "
            "use k2 or k3 as a loss"
        )
    if not kl.use_loss and kl.estimator != "k1" and kl.init_coef > 0:
        r.warnings.append(f"--algo.kl.estimator {kl.estimator} as a reward penalty: k1 is the usual choice")
    if kl.use_loss and kl.sequence_level_enable:
        r.bad(
            "algo.kl.sequence_level_enable",
            True,
            "sequence-level KL goes into the reward; not compatible with --algo.kl.use_loss",
        )
    # dynamic filtering
    if algo.dynamic_filtering_enable:
        check_pair(r, "algo.dynamic_filtering_range", algo.dynamic_filtering_range)
        if ro.n_samples_per_prompt < 2:
            r.bad("algo.dynamic_filtering_enable", True, "needs --rollout.n_samples_per_prompt >= 2")
    # reward shaping
    if rw.overlong_buffer_len is not None:
        if ro.max_new_tokens is not None and ro.max_new_tokens < rw.overlong_buffer_len:
            r.bad(
                "reward.overlong_buffer_len",
                rw.overlong_buffer_len,
                f"must be <= --rollout.max_new_tokens {ro.max_new_tokens}",
            )


def _async_and_ema(cfg: PPOConfig, r: RuleReport) -> None:
    """Async RL (partial rollout, sleeping engines) and the EMA copy under ZeRO-3."""
    t = cfg.train
    if t.partial_rollout_enable and not t.async_enable:
        r.bad("train.partial_rollout_enable", True, "needs --train.async_enable")
    if t.async_enable and cfg.vllm.enable_sleep:
        r.bad("vllm.enable_sleep", True, "not compatible with --train.async_enable")
    if t.enable_ema and cfg.ds.zero_stage == 3 and role_ranks(cfg.actor) > 1:
        r.bad("train.enable_ema", True, "not available with --ds.zero_stage 3 and several actor ranks in "
              "this version (each rank holds a shard of the weights); use --ds.zero_stage 2 or one actor "
              "rank")
