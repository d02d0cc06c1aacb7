"""Building the roles of an RL run from its config — one implementation, used by the in-process
trainer and by every rank of a Ray placement, so both start from identical models.

Each model is loaded right after seeding the RNG with `(train.seed, role)`, so a freshly
initialised head (a critic started from a policy) and the LoRA adapters (`--ds.lora.*`, actor and
critic; the critic's value head trains fully) are the same in every placement."""
from __future__ import annotations

import dataclasses

import torch

from posttrain.config import PPOConfig
from posttrain.config.ray_mode import critic_path, run_roles
from posttrain.config.roles import ActorConfig, CriticConfig
from posttrain.engines import make_train_engine
from posttrain.engines.dist import env_world, init_process_group
from posttrain.engines.zero3 import FrozenShards, shard_numel, sharded_loading
from posttrain.models import as_lora_spec, load_causal_lm, load_score_model
from posttrain.models.context_parallel import register as register_context_parallel
from posttrain.models.moe import is_moe, track_router_loss
from posttrain.models.parallel_groups import ContextGroups, ParallelLayout
from posttrain.models.vision import freeze_visual_encoder, is_vision_model, is_vision_tower_name
from posttrain.rollout.engine_builder import build_rollout_engine
from posttrain.trainers.rl.roles import Actor, Critic, Reference
from posttrain.utils.log import info
from posttrain.utils.seeding import set_seed

_ROLE_SEEDS = {"actor": 0, "critic": 1, "ref": 2}


def needs_reference(cfg: PPOConfig) -> bool:
    """A reference model of its own is loaded (not the LoRA actor's base, `reference_in_actor`)."""
    return run_roles(cfg).has("ref")


def _lora(cfg: PPOConfig) -> dict:
    """The LoRA / QLoRA keywords of the trained roles' loaders."""
    return {"lora": as_lora_spec(cfg.ds.lora), "load_in_4bit": cfg.ds.load_in_4bit}


def _seed_for(cfg: PPOConfig, role: str) -> None:
    set_seed(cfg.train.seed * 3 + _ROLE_SEEDS[role])


def context_groups(cfg: PPOConfig, model, trained: bool = False):
    """--ds.ring_attn_size N on a role of several ranks: the model's attention made context-parallel and the
    role's ranks in groups of N (collective: every rank of the role calls it), laid out with the trained roles'
    tensor-parallel groups; None otherwise."""
    rank, world, _ = env_world()
    if cfg.ds.ring_attn_size == 1 or world == 1:
        return None
    init_process_group()
    model.set_attn_implementation(register_context_parallel())
    layout = ParallelLayout(world, cfg.ds.ring_attn_size, cfg.ds.tensor_parallel_size if trained else 1)
    return ContextGroups.create(rank, layout, cfg.ds.ring_attn_head_stride)


def train_engine(model, role_cfg: ActorConfig | CriticConfig, cfg: PPOConfig, total_steps: int,
                 zero_stage: int | None):
    """The role's optimizer, scheduler and (with `zero_stage`: several ranks) DeepSpeed ZeRO engine, its model split
    over groups of --ds.tensor_parallel_size ranks (AutoTP)."""
    return make_train_engine(model, role_cfg, total_steps=max(total_steps, 1), ds=_engine_ds(cfg, zero_stage),
                             zero_stage=zero_stage,
                             tensor_parallel=cfg.ds.tensor_parallel_size if zero_stage is not None else 1)


def _engine_ds(cfg: PPOConfig, zero_stage: int | None):
    """The --ds section a role's engine reads: without ZeRO only the dtype; under ZeRO the gradient
    accumulation dtype, and offload, ZeRO++ and overlap only where there are GPUs (on CPU they are
    reported inert at start-up)."""
    gpu = zero_stage is not None and torch.cuda.is_available()
    return dataclasses.replace(
        cfg.ds, grad_accum_dtype=cfg.ds.grad_accum_dtype if zero_stage is not None else None,
        adam_offload=cfg.ds.adam_offload and gpu, zpg=cfg.ds.zpg if gpu else 1, overlap_comm=cfg.ds.overlap_comm and gpu)


def build_actor(cfg: PPOConfig, tokenizer, device, total_steps: int, zero_stage: int | None = None) -> Actor:
    """The trained policy. Under ZeRO-3 over several ranks it loads straight into shards
    (`engines.zero3.sharded_loading`): no rank holds the whole model at any time."""
    _seed_for(cfg, "actor")
    with sharded_loading(cfg.ds, zero_stage) as sharded:
        model = load_causal_lm(cfg.actor.model_name_or_path, dtype=cfg.ds.param_dtype, tokenizer=tokenizer,
                               attn_implementation=cfg.ds.attn_implementation, onednn_linear=cfg.ds.onednn_linear,
                               experts_implementation=cfg.ds.experts_implementation,
                               gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,
                               gradient_checkpointing_reentrant=cfg.actor.gradient_checkpointing_reentrant, **_lora(cfg))
    if not (cfg.ds.load_in_4bit or sharded):  # bitsandbytes places a 4-bit model itself; shards sit on their device
        model.to(device)
    model.train()
    _track_router_loss(cfg, model)
    _freeze_vision(cfg, model, announce=True)
    loaded = shard_numel(model)
    actor = Actor(model, train_engine(model, cfg.actor, cfg, total_steps, zero_stage), cfg.rollout.temperature,
                  device, ema_beta=cfg.train.ema_beta if cfg.train.enable_ema else None,
                  base_path=cfg.actor.model_name_or_path, save_merged=cfg.ckpt.save_merged,
                  dtype=cfg.ds.param_dtype or "fp32", lora_sync=cfg.vllm.lora_sync)
    actor.loaded_numel = loaded
    actor.context = context_groups(cfg, model, trained=True)
    if cfg.actor.freeze_visual_encoder and is_vision_model(model):  # OpenRLHF: only the language model syncs
        actor.sync_only = lambda name: not is_vision_tower_name(name)
    return actor


def _track_router_loss(cfg: PPOConfig, model) -> None:
    """--actor.aux_loss_coef: the actor's and the critic's MoE router loss join their losses (as OpenRLHF)."""
    if cfg.actor.aux_loss_coef > 0:
        track_router_loss(model, f"--actor.aux_loss_coef {cfg.actor.aux_loss_coef}")


def _freeze_vision(cfg: PPOConfig, model, announce: bool = False) -> None:
    """--actor.freeze_visual_encoder: a vision-language actor trains its language model only."""
    if not cfg.actor.freeze_visual_encoder:
        return
    if not is_vision_model(model):
        if announce:
            info(f"--actor.freeze_visual_encoder: {cfg.actor.model_name_or_path} has no vision tower; nothing to "
                 "freeze")
        return
    frozen = freeze_visual_encoder(model)
    if announce:
        info(f"--actor.freeze_visual_encoder: {frozen} tensors of the vision tower and its projector frozen; the "
             "language model trains")


def build_rollout_copy(cfg: PPOConfig, tokenizer, device):
    """An HF rollout engine (`rollout.engine_builder.build_rollout_engine`) over its own copy of the policy (loaded
    from --actor.model_name_or_path, eval mode): a Ray engine worker's, or the in-process async pipeline's; the
    trainer's weights reach it by sync. Its parameters keep `requires_grad` as the actor's do (it only runs
    under no_grad): torch picks other CPU kernels for frozen weights, whose rounding would differ from the
    trainer's by ~1e-6."""
    model = load_causal_lm(cfg.actor.model_name_or_path, dtype=cfg.ds.param_dtype, tokenizer=tokenizer,
                           attn_implementation=cfg.ds.attn_implementation, onednn_linear=cfg.ds.onednn_linear,
                           experts_implementation=cfg.ds.experts_implementation)
    _freeze_vision(cfg, model)  # frozen as the actor's (see above: the same kernels)
    return build_rollout_engine(cfg, tokenizer, "hf", model.to(device).eval())


def build_critic(cfg: PPOConfig, tokenizer, device, total_steps: int,
                 zero_stage: int | None = None) -> Critic:
    _seed_for(cfg, "critic")
    with sharded_loading(cfg.ds, zero_stage) as sharded:  # as the actor's
        model = load_score_model(critic_path(cfg), dtype=cfg.ds.param_dtype, value_head_prefix=cfg.ds.value_head_prefix,
                                 tokenizer=tokenizer, attn_implementation=cfg.ds.attn_implementation,
                                 onednn_linear=cfg.ds.onednn_linear,
                                 experts_implementation=cfg.ds.experts_implementation, new_head_ok=True,
                                 gradient_checkpointing=cfg.actor.gradient_checkpointing_enable,  # OpenRLHF: both
                                 gradient_checkpointing_reentrant=cfg.actor.gradient_checkpointing_reentrant,
                                 **_lora(cfg))
    if not (cfg.ds.load_in_4bit or sharded):
        model.to(device)
    model.train()
    if is_moe(model):  # a dense critic of a MoE actor has no router loss
        _track_router_loss(cfg, model)
    loaded = shard_numel(model)
    critic = Critic(model, train_engine(model, cfg.critic, cfg, total_steps, zero_stage), device,
                    normalize=bool(cfg.reward.normalize_enable))
    critic.loaded_numel = loaded
    critic.context = context_groups(cfg, model, trained=True)
    return critic


def build_reference(cfg: PPOConfig, tokenizer, device, zero_stage: int | None = None) -> Reference:
    """The frozen reference policy. Under ZeRO-3 over several ranks (a Ray reference group) it is held
    as shards across the group's ranks by an inference-only DeepSpeed engine (`engines.zero3.FrozenShards`),
    with --ref.offload keeping the shards in CPU memory (DeepSpeed's offload_param, on an accelerator);
    otherwise each rank holds a whole copy, moved to CPU between forwards with --ref.offload on an
    accelerator."""
    _seed_for(cfg, "ref")
    offload = cfg.ref.offload
    with sharded_loading(cfg.ds, zero_stage, offload_params=offload) as sharded:
        model = load_causal_lm(cfg.ref.model_name_or_path or cfg.actor.model_name_or_path, dtype=cfg.ds.param_dtype,
                               tokenizer=tokenizer, attn_implementation=cfg.ds.attn_implementation,
                               onednn_linear=cfg.ds.onednn_linear,
                               experts_implementation=cfg.ds.experts_implementation)
    model.requires_grad_(False)
    loaded = shard_numel(model)
    if sharded:
        shards = FrozenShards(model, cfg.ds, offload=offload)
        ref = Reference(shards.module, cfg.rollout.temperature, shards.device, engine=shards)
    else:
        ref = Reference(model.to(device), cfg.rollout.temperature, device, offload=offload)
    ref.loaded_numel = loaded
    ref.context = context_groups(cfg, model)
    return ref


def build_reward_source(cfg: PPOConfig, tokenizer, device, zero_stage: int | None = None):
    """The reward source: a reward model, a `reward_func` file or an HTTP server
    (`--reward.model_name_or_path` / `--reward.remote_url`). A reward model under ZeRO-3 over several ranks
    (a Ray reward group) is held as shards, as the reference is (`build_reference`); --reward.offload acts
    as --ref.offload does."""
    from posttrain.rewards import make_reward_source

    source = make_reward_source(
        cfg.reward.remote_url, cfg.reward.model_name_or_path, value_head_prefix=cfg.ds.value_head_prefix,
        normalize=cfg.reward.normalize_enable, dtype=cfg.ds.param_dtype,
        batch_size=max(cfg.rollout.micro_batch_size, 16), tokenizer=tokenizer, device=str(device),
        attn_implementation=cfg.ds.attn_implementation, onednn_linear=cfg.ds.onednn_linear,
        on_error="skip" if cfg.reward.skip_errors_enable else "raise",
        timeout=cfg.reward.timeout, retries=cfg.reward.retries, ds=cfg.ds, zero_stage=zero_stage,
        offload=cfg.reward.offload)
    if hasattr(source, "check_vocabulary"):
        source.check_vocabulary(tokenizer)
    if hasattr(source, "context"):  # a reward model
        source.context = context_groups(cfg, source.model)
    return source

