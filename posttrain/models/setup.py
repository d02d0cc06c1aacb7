"""How every model of a run is built: one `ModelSetup`, read once from the run's config, builds each role's
model (`build`) and lays out its ranks (`parallel`), returning a `BuiltModel` that holds all a role or trainer
needs of it; no trainer passes loading arguments or bolts features on by hand.

Roles (`build`'s `role`): "policy" (the model SFT / RM / DPO train: a causal LM, or a score model with
`head=True`), "actor", "critic" (a score model; its router loss only where it is a mixture of experts),
"ref" (frozen: eval mode, no gradients), "rollout" (the HF rollout engine's own copy of the policy) and
"reward" (a frozen score model).
The trained roles (policy, actor, critic) take LoRA / 4-bit, gradient checkpointing and the router loss;
the actor and the rollout copy freeze a vision-language model's vision tower when the run asks for it."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from posttrain.models.lora import LoraSpec, as_lora_spec
from posttrain.models.parallel_groups import ContextGroups, ParallelLayout

_TRAINED = ("policy", "actor", "critic")
_ROLES = _TRAINED + ("ref", "rollout", "reward")


@dataclass(frozen=True)
class BuiltModel:
    """A role's model and what comes with it. `loaded_numel`: (parameter elements this rank holds, elements of
    the whole model) right after loading (its share under ZeRO-3); `router_loss_coef`: the router loss's
    coefficient in force (0 when not tracked); `sync_only`: the weights a full-parameter sync sends (None:
    all; a frozen vision tower is left out); `layout` / `context`: set by `ModelSetup.parallel`."""
    model: torch.nn.Module
    sharded: bool = False
    loaded_numel: tuple[int, int] = (0, 0)
    router_loss_coef: float = 0.0
    sync_only: Callable[[str], bool] | None = None
    layout: ParallelLayout | None = None
    context: ContextGroups | None = None


@dataclass(frozen=True)
class ModelSetup:
    """The model set-up of a run, from its `ds` section and its trained model's section (`cfg.model` for
    sft / rm / dpo, `cfg.actor` for ppo; `serve-rm`'s `ds` section has no trained model)."""
    dtype: str = "fp32"
    attn: str | None = None  # attention backend (None: sdpa, eager where unsupported)
    onednn: bool = True  # plain linear layers through oneDNN on CPU (`cpu_linear`)
    experts: str | None = None  # a mixture of experts' expert kernels (None: transformers' choice)
    load_in_4bit: bool = False
    lora: LoraSpec | None = None
    value_head_prefix: str = "score"
    checkpointing: bool = False  # gradient checkpointing of the trained roles
    checkpointing_reentrant: bool = False
    router_loss_coef: float = 0.0
    router_loss_flag: str = "the router loss"  # the flag that asks for it (in errors)
    ring: int = 1  # context parallelism: ranks per packed row
    head_stride: int = 1
    tensor: int = 1  # tensor parallelism: ranks per copy of a trained model
    freeze_vision: bool = False

    @staticmethod
    def of(cfg) -> ModelSetup:
        """The set-up of `cfg`: a trainer's config (its `ds` section and its trained model's section), or
        serve-rm's (one frozen score model: no LoRA, checkpointing, router loss nor parallelism)."""
        ds = cfg.ds
        frozen = ModelSetup(dtype=ds.param_dtype or "fp32", attn=ds.attn_implementation,
                            onednn=ds.onednn_linear, experts=ds.experts_implementation,
                            load_in_4bit=ds.load_in_4bit,
                            value_head_prefix=getattr(ds, "value_head_prefix", "score"))
        if cfg.trainer == "serve-rm":
            return frozen
        ppo = cfg.trainer == "ppo"
        trained = cfg.actor if ppo else cfg.model
        coef = trained.aux_loss_coef
        return replace(
            frozen, lora=as_lora_spec(ds.lora), checkpointing=trained.gradient_checkpointing_enable,
            checkpointing_reentrant=trained.gradient_checkpointing_reentrant, router_loss_coef=coef,
            router_loss_flag=f"--{'actor' if ppo else 'model'}.aux_loss_coef {coef}", ring=ds.ring_attn_size,
            head_stride=ds.ring_attn_head_stride, tensor=ds.tensor_parallel_size,
            freeze_vision=ppo and bool(trained.freeze_visual_encoder))

    def load_kwargs(self, trained: bool) -> dict:
        """The loader keywords (`load_causal_lm` / `load_score_model`) of a trained or a frozen model."""
        kwargs = {"dtype": self.dtype, "attn_implementation": self.attn, "onednn_linear": self.onednn,
                  "experts_implementation": self.experts}
        if trained:
            kwargs.update(lora=self.lora, load_in_4bit=self.load_in_4bit,
                          gradient_checkpointing=self.checkpointing,
                          gradient_checkpointing_reentrant=self.checkpointing_reentrant)
        return kwargs

    def build(self, path, role: str, *, head: bool = False, tokenizer=None, device=None, sharding=None,
              head_prefix: str | None = None, new_head_ok: bool = False, split_rows: bool = False,
              announce: bool = False) -> BuiltModel:
        """`role`'s model of `path`, in this order: loaded (inside `sharding`, a context yielding whether the
        model loads as ZeRO-3 shards: `engines.zero3.sharded_loading`; None: whole); a reference frozen; moved
        to `device` (None: left where it loaded; shards and 4-bit weights stay where they loaded); the actor
        and critic put in train mode; the router loss tracked (trained roles, with a coefficient > 0; a dense
        critic skips it); the vision tower frozen (actor, rollout copy; `announce`: say so); with
        `split_rows`, attention made context-parallel (`models.context_parallel.register`). A critic or reward
        model (or `head`) is a score model with the `value_head_prefix` head (`head_prefix` overrides it);
        `new_head_ok` lets one start a new head. A frozen role's weights are not trained (LoRA, 4-bit,
        checkpointing off)."""
        from posttrain.models.loading import load_causal_lm, load_score_model

        if role not in _ROLES:
            raise ValueError(f"role {role!r}: one of {', '.join(_ROLES)}")
        trained = role in _TRAINED
        with sharding if sharding is not None else contextlib.nullcontext(False) as sharded:
            if head or role in ("critic", "reward"):
                model = load_score_model(path, value_head_prefix=head_prefix or self.value_head_prefix,
                                         tokenizer=tokenizer, new_head_ok=new_head_ok,
                                         **self.load_kwargs(trained))
            else:
                model = load_causal_lm(path, tokenizer=tokenizer, **self.load_kwargs(trained))
        if role == "ref":
            model.eval().requires_grad_(False)
        if device is not None and not sharded and not (trained and self.load_in_4bit):
            model = model.to(device)  # bitsandbytes places 4-bit weights itself; shards sit on their device
        if role in ("actor", "critic"):
            model.train()
        coef = self._track_router_loss(model, role) if trained else 0.0
        sync_only = self._freeze_vision(model, path, announce) if role in ("actor", "rollout") else None
        if split_rows:
            from posttrain.models.context_parallel import register

            model.set_attn_implementation(register())
        return BuiltModel(model, bool(sharded), shard_numel(model), coef, sync_only)

    def _track_router_loss(self, model, role: str) -> float:
        from posttrain.models.moe import is_moe, track_router_loss

        if self.router_loss_coef <= 0 or (role == "critic" and not is_moe(model)):
            return 0.0  # a dense critic of a mixture-of-experts actor has no router
        track_router_loss(model, self.router_loss_flag)
        return self.router_loss_coef

    def _freeze_vision(self, model, path, announce: bool) -> Callable[[str], bool] | None:
        """--actor.freeze_visual_encoder: a vision-language model trains its language model only, and only
        that syncs to rollout engines (as OpenRLHF). Returns the sync filter (None: every weight)."""
        from posttrain.models.vision import freeze_visual_encoder, is_vision_model, is_vision_tower_name
        from posttrain.utils.log import info

        if not self.freeze_vision:
            return None
        flag = "--actor.freeze_visual_encoder"
        if not is_vision_model(model):
            if announce:
                info(f"{flag}: {path} has no vision tower; nothing to freeze")
            return None
        frozen = freeze_visual_encoder(model)
        if announce:
            info(f"{flag}: {frozen} tensors of the vision tower and its projector frozen; the language model "
                 "trains")
        return lambda name: not is_vision_tower_name(name)

    def layout(self, world: int, trained: bool = True, split_rows: bool = True) -> ParallelLayout:
        """The ranks of a model of `world` ranks: context-parallel groups of `ring` (with `split_rows`), and
        for a trained model tensor-parallel groups of `tensor`."""
        return ParallelLayout(world, self.ring if split_rows else 1, self.tensor if trained else 1)

    def parallel(self, built: BuiltModel, rank: int, world: int, trained: bool = True,
                 split_rows: bool = True) -> BuiltModel:
        """`built` with its ranks' `layout` and, with `split_rows` and a ring over several ranks, its context
        groups: collective (every rank of the model calls it, after its train engine is built)."""
        layout = self.layout(world, trained, split_rows)
        context = ContextGroups.create(rank, layout, self.head_stride) if layout.context > 1 else None
        return replace(built, layout=layout, context=context)


def shard_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(parameter elements held by this rank, elements of the whole model); equal when not sharded."""
    own = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    return own, sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
