"""Building the roles of an RL run from its config — one implementation, used by the in-process
trainer and by every rank of a Ray placement, so both start from identical models.

Each model is loaded right after seeding the RNG with `(train.seed, role)`, so a freshly
initialised head (a critic started from a policy) and the LoRA adapters (`--ds.lora.*`, actor and
critic; the critic's value head trains fully) are the same in every placement."""
from __future__ import annotations

import dataclasses
import os

import torch

from posttrain.config import PPOConfig
from posttrain.config.ray_mode import critic_path, run_roles
from posttrain.config.roles import ActorConfig, CriticConfig
from posttrain.engines import make_train_engine
from posttrain.engines.dist import env_world, init_process_group
from posttrain.engines.zero3 import FrozenShards, sharded_loading
from posttrain.models.setup import BuiltModel, ModelSetup
from posttrain.rollout.engine_builder import build_rollout_engine
from posttrain.trainers.rl.roles import Actor, Critic, Reference
from posttrain.utils.errors import ConfigError, UserError
from posttrain.utils.log import info
from posttrain.utils.seeding import set_seed

_ROLE_SEEDS = {"actor": 0, "critic": 1, "ref": 2}


def needs_reference(cfg: PPOConfig) -> bool:
    """A reference model of its own is loaded (not the LoRA actor's base, `reference_in_actor`)."""
    return run_roles(cfg).has("ref")


def _seed_for(cfg: PPOConfig, role: str) -> None:
    set_seed(cfg.train.seed * 3 + _ROLE_SEEDS[role])


def _split_rows(setup: ModelSetup) -> bool:
    """Whether a role's rows are split by context parallelism: on a role of several ranks."""
    return setup.ring > 1 and env_world()[1] > 1


def _parallel(setup: ModelSetup, built: BuiltModel, trained: bool = False) -> BuiltModel:
    """`built` with the role's context-parallel groups (collective: every rank of the role calls it, after its
    engine is built), laid out with the trained roles' tensor-parallel groups; unchanged without them."""
    if not _split_rows(setup):
        return built
    init_process_group()
    rank, world, _ = env_world()
    return setup.parallel(built, rank, world, trained)


def train_engine(model, role_cfg: ActorConfig | CriticConfig, cfg: PPOConfig, total_steps: int,
                 zero_stage: int | None, tensor: int):
    """The role's optimizer, scheduler and (with `zero_stage`: several ranks) DeepSpeed ZeRO engine, its model
    split over tensor-parallel groups of `tensor` ranks (AutoTP)."""
    return make_train_engine(model, role_cfg, total_steps=max(total_steps, 1), ds=_engine_ds(cfg, zero_stage),
                             zero_stage=zero_stage,
                             tensor_parallel=tensor if zero_stage is not None else 1)


def _engine_ds(cfg: PPOConfig, zero_stage: int | None):
    """The --ds section a role's engine reads: without ZeRO only the dtype; under ZeRO the gradient
    accumulation dtype, and offload, ZeRO++ and overlap only where there are GPUs (on CPU they are
    reported inert at start-up)."""
    gpu = zero_stage is not None and torch.cuda.is_available()
    return dataclasses.replace(
        cfg.ds, grad_accum_dtype=cfg.ds.grad_accum_dtype if zero_stage is not None else None,
        adam_offload=cfg.ds.adam_offload and gpu, zpg=cfg.ds.zpg if gpu else 1,
        overlap_comm=cfg.ds.overlap_comm and gpu)


def build_actor(cfg: PPOConfig, tokenizer, device, total_steps: int, zero_stage: int | None = None) -> Actor:
    """The trained policy. Under ZeRO-3 over several ranks it loads straight into shards
    (`engines.zero3.sharded_loading`): no rank holds the whole model at any time."""
    setup = ModelSetup.of(cfg)
    _seed_for(cfg, "actor")
    built = setup.build(cfg.actor.model_name_or_path, "actor", tokenizer=tokenizer, device=device,
                        sharding=sharded_loading(cfg.ds, zero_stage), split_rows=_split_rows(setup),
                        announce=True)
    engine = train_engine(built.model, cfg.actor, cfg, total_steps, zero_stage, setup.tensor)
    built = _parallel(setup, built, trained=True)
    return Actor(built.model, engine, cfg.rollout.temperature, device,
                 ema_beta=cfg.train.ema_beta if cfg.train.enable_ema else None,
                 base_path=cfg.actor.model_name_or_path, save_merged=cfg.ckpt.save_merged, dtype=setup.dtype,
                 lora_sync=cfg.vllm.lora_sync, sync_only=built.sync_only, context=built.context,
                 loaded_numel=built.loaded_numel)


def build_rollout_copy(cfg: PPOConfig, tokenizer, device):
    """An HF rollout engine (`rollout.engine_builder.build_rollout_engine`) over its own copy of the policy
    (loaded from --actor.model_name_or_path, eval mode): a Ray engine worker's, or the in-process async
    pipeline's; the trainer's weights reach it by sync. Its parameters keep `requires_grad` as the actor's
    do (it only runs under no_grad): torch picks other CPU kernels for frozen weights, whose rounding would
    differ from the trainer's by ~1e-6; its vision tower is frozen as the actor's (the same kernels)."""
    built = ModelSetup.of(cfg).build(cfg.actor.model_name_or_path, "rollout", tokenizer=tokenizer,
                                     device=device)
    return build_rollout_engine(cfg, tokenizer, "hf", built.model.eval())


def build_critic(cfg: PPOConfig, tokenizer, device, total_steps: int,
                 zero_stage: int | None = None) -> Critic:
    """The value model, loaded as the actor is (its gradient checkpointing too, as OpenRLHF); it may start a
    new head."""
    setup = ModelSetup.of(cfg)
    _seed_for(cfg, "critic")
    built = setup.build(critic_path(cfg), "critic", tokenizer=tokenizer, device=device, new_head_ok=True,
                        sharding=sharded_loading(cfg.ds, zero_stage), split_rows=_split_rows(setup))
    engine = train_engine(built.model, cfg.critic, cfg, total_steps, zero_stage, setup.tensor)
    built = _parallel(setup, built, trained=True)
    return Critic(built.model, engine, device, normalize=bool(cfg.reward.normalize_enable),
                  context=built.context, loaded_numel=built.loaded_numel)


def build_reference(cfg: PPOConfig, tokenizer, device, zero_stage: int | None = None) -> Reference:
    """The frozen reference policy. Under ZeRO-3 over several ranks (a Ray reference group) it is held
    as shards across the group's ranks by an inference-only DeepSpeed engine (`engines.zero3.FrozenShards`),
    with --ref.offload keeping the shards in CPU memory (DeepSpeed's offload_param, on an accelerator);
    otherwise each rank holds a whole copy, moved to CPU between forwards with --ref.offload on an
    accelerator."""
    _seed_for(cfg, "ref")
    return _frozen_policy(cfg, cfg.ref.model_name_or_path or cfg.actor.model_name_or_path, cfg.ref.offload,
                          tokenizer, device, zero_stage)


def build_teacher(cfg: PPOConfig, tokenizer, device, zero_stage: int | None = None) -> Reference:
    """The frozen teacher of on-policy distillation (--teacher.model_name_or_path): built, placed and
    offloaded (--teacher.offload) exactly as the reference is (`build_reference`); loading it draws nothing
    from the run's RNG, so a run's other numbers do not change with it."""
    with torch.random.fork_rng(devices=[]):
        return _frozen_policy(cfg, cfg.teacher.model_name_or_path, cfg.teacher.offload, tokenizer, device,
                              zero_stage)


def _frozen_policy(cfg: PPOConfig, path: str, offload: bool, tokenizer, device,
                   zero_stage: int | None) -> Reference:
    setup = ModelSetup.of(cfg)
    built = setup.build(path, "ref", tokenizer=tokenizer, device=device, split_rows=_split_rows(setup),
                        sharding=sharded_loading(cfg.ds, zero_stage, offload_params=offload))
    shards = FrozenShards(built.model, cfg.ds, offload=offload) if built.sharded else None
    context = _parallel(setup, built).context
    if shards is not None:
        return Reference(shards.module, cfg.rollout.temperature, shards.device, engine=shards,
                         context=context, loaded_numel=built.loaded_numel)
    return Reference(built.model, cfg.rollout.temperature, device, offload=offload, context=context,
                     loaded_numel=built.loaded_numel)


def check_teacher_vocabulary(cfg: PPOConfig, tokenizer) -> None:
    """Before any model loads: the teacher reads the policy's token ids, so its folder's tokenizer (when it
    has one) must have the policy's vocabulary, and its embedding at least as many rows as the policy's
    tokenizer has tokens; else ConfigError (one line naming --teacher.model_name_or_path)."""
    from transformers import AutoConfig

    from posttrain.trainers.inputs import teacher_tokenizer_problem

    path = cfg.teacher.model_name_or_path
    flag = f"--teacher.model_name_or_path {path}"
    fix = ("on-policy distillation scores the student's sampled token ids with the teacher, so both must "
           "share one tokenizer: use a teacher of the student's tokenizer")
    problem = teacher_tokenizer_problem(path, tokenizer, fix)
    if problem:
        raise ConfigError(problem)
    config = AutoConfig.from_pretrained(path)
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if rows is not None and rows < len(tokenizer):
        raise ConfigError(f"{flag}: the teacher has a vocabulary of {rows} tokens, the policy's tokenizer "
                          f"{len(tokenizer)}; {fix}")


def build_reward_source(cfg: PPOConfig, tokenizer, device, zero_stage: int | None = None):
    """The reward source: a reward model, a `reward_func` file or an HTTP server
    (`--reward.model_name_or_path` / `--reward.remote_url`). A reward model under ZeRO-3 over several ranks
    (a Ray reward group) is held as shards, as the reference is (`build_reference`); --reward.offload acts
    as --ref.offload does."""
    from posttrain.rewards import make_reward_source

    if cfg.reward.prm:
        return build_process_reward_model(cfg, tokenizer, device, zero_stage)
    source = make_reward_source(
        cfg.reward.remote_url, cfg.reward.model_name_or_path, setup=ModelSetup.of(cfg),
        normalize=cfg.reward.normalize_enable, batch_size=max(cfg.rollout.micro_batch_size, 16),
        tokenizer=tokenizer, device=str(device),
        on_error="skip" if cfg.reward.skip_errors_enable else "raise", timeout=cfg.reward.timeout,
        retries=cfg.reward.retries, ds=cfg.ds, zero_stage=zero_stage, offload=cfg.reward.offload)
    if hasattr(source, "check_vocabulary"):
        source.check_vocabulary(tokenizer)
    return source


def prm_spec(cfg: PPOConfig):
    """--reward.prm's `PRMSpec`: the model folder's prm.json with each --reward.prm_* flag given in place of
    its field; ConfigError (one line) when there is neither a prm.json nor --reward.prm_placeholder_token, or
    the result is unusable (`PRMSpec.problem`)."""
    from posttrain.models.prm_spec import PRM_SPEC_FILE, PRMSpec, load_prm_spec

    rw = cfg.reward
    path = rw.model_name_or_path
    spec = load_prm_spec(path) if os.path.isdir(os.path.expanduser(path)) else None
    if spec is None and not rw.prm_placeholder_token:
        raise ConfigError(f"--reward.prm: {path} has no {PRM_SPEC_FILE} (which `posttrain prm` writes "
                          "beside config.json); give --reward.prm_placeholder_token (and "
                          "--reward.prm_reward_tokens, --reward.prm_step_separator unless + - and a newline)")
    spec = spec or PRMSpec(rw.prm_placeholder_token)
    given = {"placeholder_token": rw.prm_placeholder_token, "reward_tokens": rw.prm_reward_tokens,
             "step_separator": rw.prm_step_separator}
    spec = dataclasses.replace(spec, **{k: v for k, v in given.items() if v is not None})
    problem = spec.problem()
    if problem:
        raise ConfigError(f"--reward.prm: {path}: {problem} (from its {PRM_SPEC_FILE} and the "
                          "--reward.prm_* flags)")
    return spec


def check_prm(cfg: PPOConfig) -> None:
    """Before any model loads (and any Ray group starts): --reward.prm's description (`prm_spec`), a fast
    tokenizer (offsets) and the tokens (`PRMSpec.token_ids`); else ConfigError (one line). Announces the
    PRM."""
    from posttrain.models import load_tokenizer

    spec = prm_spec(cfg)
    tokenizer = load_tokenizer(cfg.reward.model_name_or_path)
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"--reward.prm: {cfg.reward.model_name_or_path}'s tokenizer is a slow one, without "
                          "character offsets (posttrain finds each step's placeholder by offset): give the "
                          "model a tokenizer.json")
    try:
        spec.token_ids(tokenizer)
    except UserError as err:
        raise ConfigError(f"--reward.prm: {err}") from None
    info(f"process reward model: {cfg.reward.model_name_or_path}; steps split on {spec.step_separator!r}, "
         f"each ended by {spec.placeholder_token!r}, scored P({spec.reward_tokens[0]!r}) among "
         f"{spec.reward_tokens}, x {cfg.reward.model_weight:g} on each step's last token")


def build_process_reward_model(cfg: PPOConfig, tokenizer, device, zero_stage: int | None = None):
    """--reward.prm's `rewards.process_reward_model.ProcessRewardSource`, placed as a reward model is
    (`build_reward_source`); `tokenizer`: the policy's, which decodes the sampled ids."""
    from posttrain.rewards.process_reward_model import ProcessRewardSource

    return ProcessRewardSource(cfg.reward.model_name_or_path, prm_spec(cfg), tokenizer,
                               setup=ModelSetup.of(cfg), batch_size=max(cfg.rollout.micro_batch_size, 16),
                               device=str(device), ds=cfg.ds, zero_stage=zero_stage,
                               offload=cfg.reward.offload)


def build_reward_functions(cfg: PPOConfig) -> list:
    """The `--reward.func_path` files as weighted terms (`rewards.composite.Term`), loaded now; [] without
    them. They run in the controller, with `--reward.skip_errors_enable`, `--reward.timeout` and
    `--reward.retries` as a `--reward.remote_url FILE.py` does."""
    from posttrain.rewards import function_terms
    from posttrain.rewards.pick_source import FUNC_TIMEOUT

    rw = cfg.reward
    if not rw.func_path:
        return []
    return function_terms(rw.func_path, rw.func_weights,
                          on_error="skip" if rw.skip_errors_enable else "raise",
                          timeout=FUNC_TIMEOUT if rw.timeout is None else rw.timeout, retries=rw.retries)


def combine_rewards(cfg: PPOConfig, main, functions: list):
    """The run's reward source: `main` (the reward model, its Ray group, or --reward.remote_url's source;
    may be None) alone, or with the `functions` terms summed (`rewards.composite.combine`), its term named
    `model` or `remote` and weighted by --reward.model_weight."""
    from posttrain.rewards import combine

    name = "remote" if cfg.reward.remote_url else "model"
    return combine(functions, main, name, cfg.reward.model_weight)

