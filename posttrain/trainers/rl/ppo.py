"""The RL loop (`posttrain ppo`): for each step, collect a rollout batch, turn it into experience
(old/reference log-probs, values, KL, rewards → advantages), update the critic and the policy, sync
the rollout engines' weights, then log, evaluate and checkpoint. The loop calls only role methods:
the roles live in this process (`roles.py`), or are Ray actor groups with the same methods
(`trainers/rl/placement/ray_placement.py`) when `config.ray_mode.uses_ray`. Resume, the eval / log / save
cadence, Ctrl-C and the final charts come from the loop every trainer shares
(`trainers/run_loop.RunLoop`). Besides the roles, the trainer holds the run's prompts and generation
budgets (`run_parts.PromptData`) and where the loop stands (`run_parts.LoopState`)."""
from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from posttrain.algorithms.kl import AdaptiveKLController, FixedKLController
from posttrain.config import (
    ConfigError,
    PPOConfig,
)
from posttrain.config.backends import one_process_engine
from posttrain.config.ray_mode import run_roles
from posttrain.config.roles import SEQUENCE_POLICY_LOSSES
from posttrain.models import load_tokenizer
from posttrain.models.setup import ModelSetup
from posttrain.rollout import SamplingParams, rank_seed
from posttrain.rollout.engine_builder import build_rollout_engine
from posttrain.rollout.single_turn import SingleTurnSampler
from posttrain.trainers.rl import build
from posttrain.trainers.rl.async_pipeline import RolloutPipeline, staleness_metrics
from posttrain.trainers.rl.batch_forward import ppo_batchings
from posttrain.trainers.rl.collect import ShapingSettings, collect
from posttrain.trainers.rl.eval_rollouts import eval_metrics
from posttrain.trainers.rl.experience_maker import ExperienceMaker, rollout_metrics
from posttrain.trainers.rl.roles import AdapterOffReference
from posttrain.trainers.rl.run_parts import load_prompt_data, loop_state
from posttrain.trainers.rl.updates import UpdateSettings, steps_per_rollout
from posttrain.trainers.run_loop import Cadence, RunLoop, best_of_old_state, plot_charts
from posttrain.trainers.session import RunStart
from posttrain.utils.checkpoint import disk_full_as_error, load_state_file, save_state_file
from posttrain.utils.log import info, warn_once
from posttrain.utils.metrics import truncate_jsonl_after
from posttrain.utils.seeding import rng_state, set_rng_state
from posttrain.utils.timer import Timers


def _announce_teacher(cfg: PPOConfig) -> None:
    """Start-up's line on on-policy distillation: the teacher, its weight, whether it is the only reward."""
    rw = cfg.reward
    coef = 1.0 if cfg.algo.teacher_coef is None else cfg.algo.teacher_coef
    alone = not (rw.model_name_or_path or rw.remote_url or rw.func_path or cfg.train.agent_func_path)
    info(f"on-policy distillation: teacher {cfg.teacher.model_name_or_path}; each sampled token's reward "
         f"takes -{coef:g} x (log pi_old - log pi_teacher)"
         + (", the only reward (no reward source)" if alone else ""))


class RLTrainer(RunLoop):
    desc = "rl"

    def __init__(self, cfg: PPOConfig) -> None:
        self.cfg = cfg
        self.start = RunStart(cfg)  # the controller's process (validation refuses WORLD_SIZE > 1)
        self.roles = run_roles(cfg)  # which roles this run loads, and whether on Ray
        self.placement = None
        with self.start.closed_on_error():
            try:
                # the model folders and their config.json were checked by RunStart (`check_inputs`)
                self.tokenizer = load_tokenizer(cfg.actor.model_name_or_path,
                                                use_fast=not cfg.data.disable_fast_tokenizer,
                                                chat_template=cfg.data.tokenizer_chat_template)
                tools = None  # --train.tool_path's tools: the prompts are rendered with them
                if cfg.train.tool_path:
                    from posttrain.agents.tool_env import load_tool_file

                    tools = load_tool_file(cfg.train.tool_path, self.tokenizer)
                self.data = load_prompt_data(cfg, self.tokenizer, tools)
                agent, prm = self._load_reward_source(tools)
                teacher, prm = self._load_models(agent, prm)
                self._build_loop_state(teacher, prm)
            except BaseException:
                self._release_placement()
                raise

    @property
    def device(self):
        return self.start.device

    @property
    def shares_actor_module(self) -> bool:
        """The rollout engine samples from the actor's own module (one process, not async)."""
        return not self.roles.on_ray and not self.cfg.train.async_enable

    # ---- set-up -----------------------------------------------------------------------------
    def _load_reward_source(self, tools=None):
        """The reward source (and the agent file, returned: None without one) first, before the policy
        loads: a missing or broken reward or agent file, an unreachable-by-design URL or a mismatched
        reward model stops the run before the expensive part. Under Ray a reward model is loaded by its
        own ranks (with the other roles). With an agent file and no reward flag, the environment gives
        every reward. With `tools` (a tool file's) the executor runs tool episodes. Also returns the
        process reward model when it is loaded here (--reward.prm in one process; else None)."""
        cfg = self.cfg
        agent = None
        if cfg.train.agent_func_path:
            from posttrain.agents.agent_file import load_agent_executor

            agent = load_agent_executor(cfg.train.agent_func_path)
            info(f"agent: {type(agent).__name__} from {cfg.train.agent_func_path}; episodes of up to "
                 f"--data.max_len {cfg.data.max_len} tokens over all turns")
        elif tools is not None:  # a tool file (`agents.tool_env`)
            from posttrain.agents.tool_env import ToolAgentExecutor

            agent = ToolAgentExecutor(tools)
            info(f"tools: {', '.join(tools.names)} from {cfg.train.tool_path}; episodes of up to "
                 f"--data.max_len {cfg.data.max_len} tokens over all turns, scored by the reward source")
        functions = build.build_reward_functions(cfg)  # --reward.func_path terms (or [])
        main = None
        has_reward = cfg.reward.model_name_or_path or cfg.reward.remote_url
        in_process = not (self.roles.on_ray and self.roles.has("reward"))
        prm = None  # a process reward model: its step scores are token rewards (`ExperienceMaker`)
        if cfg.reward.prm:
            build.check_prm(cfg)
            if in_process:
                prm = build.build_process_reward_model(cfg, self.tokenizer, self.device)
        elif has_reward and in_process:
            main = build.build_reward_source(cfg, self.tokenizer, self.device)
        # on Ray with a reward model: the functions alone until the model's group joins them (`_place_on_ray`)
        self.reward_source = build.combine_rewards(cfg, main, functions)
        return agent, prm

    def _load_models(self, agent, prm=None):
        """Every role; returns the teacher of on-policy distillation and the process reward model (`prm`,
        or on Ray the reward group when it is one; None without)."""
        cfg = self.cfg
        n = cfg.rollout.n_samples_per_prompt
        steps_per_episode = len(self.data.prompts) // cfg.rollout.batch_size
        if steps_per_episode == 0:
            raise ConfigError(f"{len(self.data.prompts)} prompts are fewer than one rollout batch "
                              f"(--rollout.batch_size {cfg.rollout.batch_size}); lower it or add prompts")
        self.total_steps = cfg.train.max_steps or steps_per_episode * cfg.train.num_episodes
        updates = self.total_steps * steps_per_rollout(cfg.rollout.batch_size * n, cfg.train.batch_size,
                                                       cfg.train.max_epochs)
        trained = (("actor.", cfg.actor),) + ((("critic.", cfg.critic),) if self.roles.has("critic") else ())
        if self.roles.has("teacher"):  # before any model loads
            build.check_teacher_vocabulary(cfg, self.tokenizer)
            _announce_teacher(cfg)
        self.start.announce(updates, trained)
        teacher = None
        if self.roles.on_ray:
            teacher, placed_prm = self._place_on_ray(updates)
            prm = placed_prm or prm
        else:
            self.actor = build.build_actor(cfg, self.tokenizer, self.device, updates)
            self.critic = (build.build_critic(cfg, self.tokenizer, self.device, updates)
                           if self.roles.has("critic") else None)
            self.ref = (build.build_reference(cfg, self.tokenizer, self.device) if self.roles.has("ref")
                        else None)
            if self.roles.has("teacher"):
                teacher = build.build_teacher(cfg, self.tokenizer, self.device)
            info(f"rollout engine: {one_process_engine(cfg)}")
            if cfg.train.async_enable:  # generation runs while the actor trains: an engine of its own
                with torch.random.fork_rng(devices=[]):  # loading it draws nothing from the run's RNG
                    self.rollout_engine = build.build_rollout_copy(cfg, self.tokenizer, self.device)
            else:  # in one process the rollout engine samples from the actor's own module (no weight copy)
                self.rollout_engine = build_rollout_engine(cfg, self.tokenizer, "hf", self.actor.model,
                                                           shared=True)
        self._report_reference()
        kl = cfg.algo.kl
        self.kl_ctl = (AdaptiveKLController(kl.init_coef, kl.target, kl.horizon) if kl.target
                       else FixedKLController(kl.init_coef))
        self.executor = self._executor(agent)
        return teacher, prm

    def _report_reference(self) -> None:
        """The reference of a LoRA run that starts from the actor's weights is the actor's base with the
        adapter disabled (`reference_in_actor`); start-up names where the reference comes from."""
        cfg = self.cfg
        if self.roles.reference_in_actor:
            self.ref = AdapterOffReference(self.actor)
            info("reference model: the actor's base weights with its LoRA adapter disabled (no second copy)")
        elif self.ref is None:
            info("no reference model loaded: --algo.kl.init_coef 0 and KL is not used as a loss")
        elif cfg.ds.lora.rank > 0:
            info(f"reference model: {cfg.ref.model_name_or_path} (a copy of its own, without LoRA)")

    def _executor(self, agent):
        """Single-turn sampling and batched rewards, or the `agent`'s multi-turn episodes."""
        if agent is None:
            return SingleTurnSampler(self.rollout_engine, self.reward_source, self.tokenizer)
        from posttrain.agents.multi_turn import AgentRunner

        return AgentRunner.from_config(agent, self.rollout_engine, self.tokenizer, self.reward_source,
                                       self.cfg, processor=self.data.processor)

    def _place_on_ray(self, updates: int):
        """Every role as a Ray actor group (`placement/ray_placement.py`); the groups have the roles'
        methods, so the rest of the loop does not change. Returns the teacher's group and the reward group
        when it is a process reward model (each None without one)."""
        from posttrain.trainers.rl.placement.ray_placement import RayPlacement

        self.placement = RayPlacement(self.cfg, updates)
        p = self.placement
        self.actor, self.critic, self.ref, self.rollout_engine = p.actor, p.critic, p.ref, p.engines
        if p.reward is not None and self.cfg.reward.prm:
            return p.teacher, p.reward
        if p.reward is not None:  # the reward model's Ray group, with the function terms when given
            functions = self.reward_source.terms if self.reward_source is not None else []
            self.reward_source = build.combine_rewards(self.cfg, p.reward, functions)
        return p.teacher, None

    def _build_loop_state(self, teacher=None, prm=None) -> None:
        cfg = self.cfg
        a = cfg.actor
        eps_low, eps_high = a.eps_clip_low_high if a.eps_clip_low_high else (a.eps_clip, a.eps_clip)
        adv = cfg.algo.advantage
        # GSPO (as OpenRLHF) and seq_sum: --actor.loss_agg aggregates the policy term only (sequence-level
        # by default); the KL-loss / entropy / value terms stay token means. Otherwise it applies to all.
        other_agg = "token_mean" if a.policy_loss_type in SEQUENCE_POLICY_LOSSES else a.loss_agg
        shared = cfg.ds.shared_prefix and self.data.processor is None  # a VLM takes padded batches
        train_batching, forward_batching, ref_batching = ppo_batchings(cfg, shared)
        self.update_settings = UpdateSettings(
            batch_size=cfg.train.batch_size, batching=train_batching,
            max_epochs=cfg.train.max_epochs, loss_agg=other_agg, policy_loss_agg=a.loss_agg,
            max_len=self.data.max_new_tokens, eps_low=eps_low,
            eps_high=eps_high, dual_clip=a.dual_clip, policy_loss_type=a.policy_loss_type,
            entropy_coef=a.entropy_coef, kl_use_loss=cfg.algo.kl.use_loss, kl_estimator=cfg.algo.kl.estimator,
            kl_clamp=cfg.algo.kl.clamp or None,
            is_correction=adv.is_correction_type if adv.is_correction_enable else None,
            is_threshold=tuple(adv.is_correction_threshold), value_clip=cfg.critic.value_clip,
            seed=cfg.train.seed, router_loss_coef=ModelSetup.of(cfg).router_loss_coef)
        penalty = cfg.reward.missing_eos_penalty
        self.shaping = ShapingSettings(cfg.reward.overlong_buffer_len, cfg.reward.overlong_penalty_factor,
                                       cfg.reward.stop_properly_penalty_coef, penalty,
                                       self._eos_ids() if penalty is not None else ())
        self.experience_maker = ExperienceMaker(cfg, self.actor, self.ref, self.critic, forward_batching,
                                                self.tokenizer.pad_token_id, ref_batching, teacher, prm)
        self.state = loop_state(cfg, len(self.data.prompts))
        self.timers = Timers()
        # ckpt None: no --ckpt.save_steps and no --ckpt.load_enable, or --ckpt.disable_ds
        cadence = Cadence(logging_steps=cfg.logger.logging_steps, eval_steps=cfg.eval.steps,
                          save_steps=cfg.ckpt.save_steps, load_checkpoint=cfg.ckpt.load_enable,
                          save_hf=cfg.ckpt.save_hf, keep_best=cfg.ckpt.best_metric_key != "none")
        super().__init__(total_steps=self.total_steps, logger=self.start.open_logger(cfg),
                         ckpt=self.start.folders.ckpt, cadence=cadence)
        # a fresh start: samples.jsonl starts over, as metrics.jsonl
        if self.start.folders.resume_from is None:
            (self.start.output_dir / "samples.jsonl").unlink(missing_ok=True)

    def _eos_ids(self) -> tuple[int, ...]:
        """The rollout engines' default stop ids (the tokenizer's eos and the policy's generation config,
        `resolve_eos_ids`), which --reward.missing_eos_penalty looks for: the in-process engine's own, or
        the first Ray engine's (they all build them alike)."""
        ids = getattr(self.rollout_engine, "eos_token_ids", None)
        if ids is None and hasattr(self.rollout_engine, "call"):
            ids = self.rollout_engine.first(self.rollout_engine.call("eos_token_ids") + [[]])
        if not ids:
            raise ConfigError("--reward.missing_eos_penalty: the rollout engine has no EOS id (the tokenizer "
                              "and the model's generation config name none), so every sample would be "
                              "penalised")
        return tuple(int(i) for i in ids)

    # ---- one step ---------------------------------------------------------------------------
    def sampling_params(self, step: int, evaluation: bool = False) -> SamplingParams:
        cfg = self.cfg
        budget, stops = self.data.max_new_tokens, cfg.rollout.stop_token_ids
        if evaluation:
            return SamplingParams(temperature=cfg.eval.temperature, top_p=cfg.rollout.top_p,
                                  max_new_tokens=budget, n=cfg.eval.n_samples_per_prompt,
                                  seed=rank_seed(cfg.train.seed + 1, 0, step), stop_token_ids=stops)
        return SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              max_new_tokens=budget, n=cfg.rollout.n_samples_per_prompt,
                              seed=rank_seed(cfg.train.seed, 0, step), stop_token_ids=stops)

    def produce(self, step: int):
        """The rollout batch of `step`: (scored rollouts, their metrics, the prompt cursor after its last
        group). On the producer thread in async mode. With oversampling (`self.state.oversampled`) the batch
        comes from the group buffer, refilled by generation calls of --rollout.vllm_generate_batch_size
        prompts."""
        cfg = self.cfg
        with self._generation_weights():
            if self.state.oversampled is None:
                scored, metrics = self._draw(step, cfg.rollout.batch_size, release_engines=True)
                cursor = self.state.stream.cursor
            else:
                scored, metrics, cursor = self.state.oversampled.take(
                    lambda: self._draw(step, cfg.rollout.vllm_generate_batch_size, release_engines=False))
        metrics.update(rollout_metrics(scored, cfg.rollout.n_samples_per_prompt))
        return scored, metrics, cursor

    def _generation_weights(self):
        """The context a rollout or evaluation batch is generated in. When the rollout engine samples from
        the actor's own module (one process, not async) and --ds.gather_for_generation: the actor engine's
        `gathered_for_generation` (under ZeRO-3 the weights are gathered once per batch, not per layer
        and decode step; a no-op for other engines). Otherwise nothing: generation runs from the sharded
        module, or the engines hold their own copies (weight sync honours the flag, `placement/workers.py`).
        An engine sampling from the actor's module frees its fused decode weights after the batch; sleeping
        Ray engines (--vllm.enable_sleep) wake for the batch and sleep after it."""
        if self.shares_actor_module and self.cfg.ds.gather_for_generation:
            return self.actor.engine.gathered_for_generation()
        if self.shares_actor_module and hasattr(self.rollout_engine, "release_decode_weights"):
            return self._released_decode_weights()
        if getattr(self.rollout_engine, "sleep_level", 0):
            return self._awake_engines()
        return nullcontext()

    @contextmanager
    def _awake_engines(self):
        """--vllm.enable_sleep: the Ray engines wake for a batch and sleep again after it (OpenRLHF's hybrid
        engine). Engines whose weights a level-2 sleep discarded since the last sync (after an evaluation
        batch, which follows the step's sync) take a full sync first."""
        self.rollout_engine.wake_up()
        if getattr(self.rollout_engine, "discarded", False):
            self._sync_engines()
        try:
            yield
        finally:
            self.rollout_engine.sleep()

    @contextmanager
    def _released_decode_weights(self):
        """The fast decode path's fused copies of the weights are freed after a batch from the trained
        module: training changes the weights anyway, and the copies would otherwise sit in memory through
        the update (a second copy of the linear weights: +2.1 GiB of peak at the 0.5B shape)."""
        try:
            yield
        finally:
            self.rollout_engine.release_decode_weights()

    def _draw(self, step: int, prompts: int, release_engines: bool):
        """`collect` of `prompts` groups. Async: each sample without versions recorded by its engine gets
        the current one, and (`release_engines`, single-turn, no filtering) the engines are free for a
        weight sync as soon as the batch is generated, while its reward scores (with filtering a refill
        draw may follow the scores)."""
        cfg = self.cfg
        filt = tuple(cfg.algo.dynamic_filtering_range) if cfg.algo.dynamic_filtering_enable else None
        hook, version = {}, self.state.policy_version
        if (self.state.pipeline is not None and release_engines and filt is None
                and isinstance(self.executor, SingleTurnSampler)):
            hook["on_generated"] = self.state.pipeline.generated
        params = self.sampling_params(step)
        if self.state.oversampled is not None:  # several draws per step, or none: seeded by where they start
            params = replace(params, seed=rank_seed(cfg.train.seed, 2, self.state.stream.cursor))
        scored, metrics = collect(self.executor, self.data.prompts, self.state.stream, params,
                                  batch_size=prompts, shaping=self.shaping, filter_range=filt,
                                  max_extra_draws=4 * prompts, max_len=self.data.sample_max_len, **hook)
        if self.state.pipeline is not None:
            for r in scored.rollouts:
                r.policy_versions = r.policy_versions or [version]
        return scored, metrics

    def _next_batch(self, step: int):
        """This step's rollouts: generated now (sync), or taken from the pipeline with its async metrics."""
        if self.state.pipeline is None:
            with self.timers("generation"):
                scored, metrics, self.state.trained_cursor = self.produce(step)
            return scored, metrics
        t0 = time.perf_counter()
        item = self.state.pipeline.get(step)
        scored, metrics, self.state.trained_cursor = item.result
        metrics.update(staleness_metrics(scored.rollouts, item.version, self.state.policy_version))
        metrics["async/queue_wait"] = time.perf_counter() - t0
        self.timers.add("generation", item.seconds)
        return scored, metrics

    def step(self) -> dict[str, float]:
        cfg = self.cfg
        step = self.global_step
        with self.timers("step_total"):
            scored, metrics = self._next_batch(step)
            with self.timers("make_experience"):
                exp, exp_metrics = self.experience_maker.make(scored, self.kl_ctl.value)
            metrics.update(exp_metrics)
            with self.timers("ppo_train"):
                if self.critic is not None:
                    metrics.update(self.critic.fit(exp, self.update_settings, step))
                # the actor waits only for a critic to warm up (without one, --critic.freezing_steps is inert)
                actor_trains = self.critic is None or step >= cfg.critic.freezing_steps
                if actor_trains:
                    metrics.update(self.actor.fit(exp, self.update_settings, self.kl_ctl.value, step))
                if actor_trains or self.state.pipeline is not None:  # async: every step is a version
                    with self.timers("weight_sync"):
                        metrics.update(self._sync_after(step))
            # OpenRLHF's statistic: the experience KL, or with KL as a loss the KL measured in training;
            # no update while the actor is frozen (no KL status then)
            current_kl = metrics.get("actor/kl_loss" if cfg.algo.kl.use_loss else "kl/mean")
            if actor_trains and current_kl is not None:
                self.kl_ctl.update(current_kl, len(exp))
                if getattr(self.kl_ctl, "compounded", False):
                    warn_once(f"adaptive KL: {len(exp)} samples per step exceed --algo.kl.horizon "
                              f"({cfg.algo.kl.horizon}); the per-horizon change is compounded (OpenRLHF's "
                              "linear update would overshoot, and turn the coefficient negative beyond 5 x "
                              "horizon)")
            metrics["kl/coef"] = self.kl_ctl.value
        if self.state.pipeline is not None:
            self.state.pipeline.step_done(step)
        metrics.update(self.timers.pop_metrics())
        self._write_samples(step + 1, scored)
        return metrics

    def _sync_after(self, step: int) -> dict[str, float]:
        """The engines take the weights of step `step` (policy version step + 1). Async without partial
        rollout: once the batch that must be sampled by the previous version has started, and never
        during a generation (the producer holds `gen_lock` while it generates): `async/sync_wait` is
        the time spent waiting for that (inside `timing/weight_sync`). `sync/bytes`: the bytes sent (a
        LoRA actor's adapter only; 0 when the engine shares the actor's module)."""
        if self.state.pipeline is None:
            return {"sync/bytes": self._sync_engines()}
        t0 = time.perf_counter()
        self.state.pipeline.before_sync(step)
        with self.state.gen_lock if self.state.pipeline.hold_lock else nullcontext():
            waited = time.perf_counter() - t0
            sent = self._sync_engines(version=step + 1)
            self.state.policy_version = step + 1
        return {"async/sync_wait": waited, "sync/bytes": sent}

    def _write_samples(self, step: int, scored, k: int = 4) -> None:
        with (self.start.output_dir / "samples.jsonl").open("a") as f:
            for r, reward in list(zip(scored.rollouts, scored.rewards.tolist()))[:k]:
                f.write(json.dumps({"step": step, "prompt": r.prompt_text, "response": r.response_text,
                                    "label": r.label, "reward": reward, "finish_reason": r.finish_reason},
                                   default=str) + "\n")

    # ---- RunLoop's hooks (trainers/run_loop.py) ---------------------------------------------
    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}", "len": f"{metrics['response/length']:.1f}",
                "kl": f"{metrics.get('kl/mean', 0.0):.4f}"}

    def evaluate(self) -> dict[str, float]:
        if self.data.eval_prompts is None:
            return {}
        # async: evaluation does not interleave with the producer's generation (OpenRLHF holds its lock)
        lock = self.state.gen_lock if self.state.pipeline is not None else nullcontext()
        with self.timers("eval"), lock, self._generation_weights():
            return eval_metrics(self.executor, self.data.eval_prompts,
                                self.sampling_params(self.global_step, True), self.data.eval_name,
                                max_len=self.data.sample_max_len)

    def on_evaluated(self, eval_metrics: dict[str, float], metrics: dict[str, float]) -> None:
        metrics.update(self.timers.pop_metrics())

    def metric_key(self, eval_metrics: dict[str, float]) -> str | None:
        """--ckpt.best_metric_key ('none': None; '': the first `*_pass1` key, sorted, as OpenRLHF); higher is
        better."""
        key = self.cfg.ckpt.best_metric_key
        if key == "none":
            return None
        if not key:
            key = next((k for k in sorted(eval_metrics) if k.endswith("_pass1")), None)
        return key if key in eval_metrics else None

    def export_best(self, best: dict) -> None:
        """The best policy's HF copy (EMA weights when kept) in `<output_dir>/best/`, with `best_metric.json`;
        written to a temp folder and renamed into place."""
        final, tmp, old = (self.start.output_dir / name for name in ("best", ".tmp_best", ".old_best"))
        for p in (tmp, old):
            shutil.rmtree(p, ignore_errors=True)
        self.actor.export(tmp, self.data.savers)
        (tmp / "best_metric.json").write_text(json.dumps(best))
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        info(f"best model ({best['key']} = {best['value']:.4f} at step {best['step']}) saved to {final}")

    def write_checkpoint(self, d: Path) -> None:
        self.actor.save_state(d / "actor")
        if self.critic is not None:
            self.critic.save_state(d / "critic")
        state = {"global_step": self.global_step, "prompt_cursor": int(self.state.trained_cursor),
                 "kl_ctl": self.kl_ctl.state_dict(), "rng": rng_state()}
        save_state_file(state, d / "trainer_state.pt")

    def export_hf(self, d: Path) -> None:
        self.actor.export(d, self.data.savers)  # as the final export (EMA weights when kept, as OpenRLHF)

    def restore(self, path: Path, meta: dict) -> None:
        state = load_state_file(path / "trainer_state.pt")
        self.actor.load_state(path / "actor")
        if self.critic is not None:
            self.critic.load_state(path / "critic")
        self.state.stream.cursor = self.state.trained_cursor = state["prompt_cursor"]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        set_rng_state(state["rng"])
        if "best" not in meta:  # a checkpoint from before meta["best"] kept it in its trainer state
            self.record.best = best_of_old_state(state.get("best")) or self.record.best
        if self.is_main:  # samples of the steps after the checkpoint are written again
            truncate_jsonl_after(self.start.output_dir / "samples.jsonl", int(meta["global_step"]))

    def before_loop(self) -> None:
        self.state.policy_version = self.global_step
        self._sync_engines(verify=True, version=self.state.policy_version)
        cfg = self.cfg
        if cfg.train.async_enable and self.global_step < self.total_steps:
            self.state.pipeline = RolloutPipeline(
                self.produce, lambda: self.state.policy_version, first=self.global_step,
                last=self.total_steps, lookahead=cfg.train.async_queue_size, lock=self.state.gen_lock,
                hold_lock=not cfg.train.partial_rollout_enable)
            self.state.pipeline.start()  # after the assignment: `produce` reads `self.state.pipeline`
            info(f"async RL: rollouts generated up to {cfg.train.async_queue_size} step(s) ahead of training"
                 + (", partial rollout (weights sync between decode steps)"
                    if cfg.train.partial_rollout_enable else f" (staleness {cfg.train.async_queue_size})"))

    def _close_pipeline(self) -> None:
        """Stop the producer; a batch generated but never trained is dropped (a resume regenerates it)."""
        if self.state.pipeline is None:
            return
        dropped = self.state.pipeline.close(timeout=30)
        if dropped:
            info(f"async RL: {dropped} generated batch(es) dropped untrained; a resume regenerates them")
        if self.state.pipeline.running:
            info("async RL: the rollout producer is still generating; it stops with this process")
        self.state.pipeline = None

    def after_loop(self) -> None:
        self._export()
        self.logger.close()
        plot_charts(self.start.output_dir)
        self.start.finish()

    def fit(self) -> dict[str, float]:
        """Train (resuming if asked); Ctrl-C ends in `Interrupted`; the run directory, the reward
        source and the Ray placement are released however it ends."""
        self.start.begin()
        try:
            return super().fit()
        finally:
            self._close_pipeline()
            if hasattr(self.executor, "close"):
                self.executor.close()
            if self.reward_source is not None:
                self.reward_source.close()
            self._release_placement()
            self.start.folders.close()

    def _release_placement(self) -> None:
        if self.placement is not None:
            self.placement.shutdown()
            self.placement = None

    def _sync_engines(self, verify: bool = False, version: int | None = None) -> int:
        """The rollout engines take the actor's weights (a no-op in one process without async: the engine
        shares the actor's module); a LoRA actor sends base + adapter with `verify` (the first sync), else
        the adapter only. `verify`: check each engine's weights hash equals the trainer's (base + adapter +
        scaling with LoRA); `version`: the policy version the engines record per token (async). Returns
        the bytes sent."""
        sent = self.actor.broadcast_weights([self.rollout_engine], verify, version)
        if verify and self.placement is not None:
            expected, got = self.actor.weights_hash(), self.rollout_engine.weights_hashes()
            bad = [i for i, h in enumerate(got) if h != expected]
            if bad:
                raise RuntimeError(f"weight sync failed: rollout engine(s) {bad} hold other weights than the "
                                   "actor")
            info(f"weight sync verified: {len(got)} rollout engine(s) hold the actor's weights")
        elif verify and self.cfg.train.async_enable:  # in one process, the async engine's own copy
            if self.rollout_engine.weights_hash() != self.actor.weights_hash():
                raise RuntimeError("weight sync failed: the async rollout engine holds other weights than "
                                   "the actor")
            info("weight sync verified: the async rollout engine holds the actor's weights")
        return sent

    def _export(self) -> None:
        if self.actor.keeps_ema:
            info("--train.enable_ema: the saved final model holds the EMA weights")
        out = self.start.output_dir
        with disk_full_as_error("the final model", out, self.start.folders.last_checkpoint()):
            self.actor.export(out, self.data.savers)
            if self.critic is not None and self.cfg.critic.save_value_network:
                self.critic.export(out / "critic", self.tokenizer)
        info(f"final model saved to {out}")


def train_rl(cfg: PPOConfig) -> dict[str, float]:
    return RLTrainer(cfg).fit()
