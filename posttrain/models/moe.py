"""Mixture-of-experts models: detection, the router load-balancing loss, and the expert blocks that ZeRO-3
must gather whole.

Router loss (its coefficient: `models.setup.ModelSetup.router_loss_coef`): `track_router_loss(model)` hooks
the model's decoder to return its router logits; after each forward, `take_router_loss(model)` returns the
family's own load-balancing loss of that forward (the `load_balancing_loss_func` of the model's transformers
module: for Qwen3-MoE / Mixtral, E * sum_e f_e * P_e over the layers' tokens, f_e the share of routing slots
(top-k) that chose expert e, P_e the mean router probability of e; padding left out when the batch has a 2-D
attention mask). Inside `router_token_weights(model, w)` the means weigh token (r, t) by w[r, t] instead: a
layout computing one token for several samples (a shared prompt) counts it once per sample, as the per-sample
rows would.

ZeRO-3 leaves (`mark_zero3_leaves`): DeepSpeed gathers a leaf module's parameters whole before its forward
instead of following the order its hooks recorded; routing changes which experts run from batch to batch, so
the sparse expert blocks are leaves (as OpenRLHF marks them)."""
from __future__ import annotations

import contextlib
import sys

import torch

from posttrain.models.config_facts import EXPERT_COUNT_KEYS, is_moe, text_config  # noqa: F401 (imported from here)
from posttrain.models.saving import unwrap_model
from posttrain.utils.errors import UserError

_TRACKER = "_posttrain_router_loss"


def expert_block_classes(model: torch.nn.Module) -> list[type]:
    """The classes of the model's sparse expert blocks: modules with an `experts` child and a router (`gate`
    or `router`), e.g. Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock."""
    found: dict[type, None] = {}
    for module in model.modules():
        children = dict(module.named_children())
        if "experts" in children and ("gate" in children or "router" in children):
            found[type(module)] = None
    return list(found)


def mark_zero3_leaves(model: torch.nn.Module) -> list[str]:
    """Mark the expert blocks as ZeRO-3 leaf modules (before DeepSpeed wraps the model); returns their class
    names (empty for a dense model)."""
    classes = expert_block_classes(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]


def _base(model):
    base = unwrap_model(model)
    if hasattr(base, "peft_config"):
        base = base.get_base_model()
    return base


class _RouterLoss:
    def __init__(self, base: torch.nn.Module) -> None:
        config = text_config(base.config)
        self.num_experts = next(getattr(config, k) for k in EXPERT_COUNT_KEYS if getattr(config, k, None))
        self.top_k = config.num_experts_per_tok
        module = sys.modules[type(base).__module__]
        self.loss_fn = getattr(module, "load_balancing_loss_func", None)
        if self.loss_fn is None:
            raise ValueError(f"{type(base).__name__}: its transformers module defines no "
                             "load_balancing_loss_func, so its router loss is unknown")
        self.last: tuple | None = None  # the last forward's router logits and token mask
        self.weights: torch.Tensor | None = None  # set by `router_token_weights`

    def capture(self, _module, _args, kwargs, output) -> None:
        logits = getattr(output, "router_logits", None)
        if not logits:
            return
        rows = logits[0].shape[0]  # a 2-D mask of these very tokens (not of a KV cache's past as well)
        if self.weights is not None and self.weights.numel() == rows:
            self.last = (logits, self.weights)
            return
        mask = kwargs.get("attention_mask")
        mine = isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.numel() == rows
        self.last = (logits, mask if mine else None)

    def take(self) -> torch.Tensor | None:
        if self.last is None:
            return None
        (logits, mask), self.last = self.last, None
        return self.loss_fn(logits, self.num_experts, self.top_k, mask)


def _with_router_logits(_module, args, kwargs):
    return args, {**kwargs, "output_router_logits": True}


def track_router_loss(model: torch.nn.Module, flag: str = "the router loss") -> None:
    """Every forward of `model` (a MoE model, possibly peft-wrapped) computes its routers' logits and keeps
    the load-balancing loss of the last forward for `take_router_loss`. A UserError naming `flag` for a dense
    model."""
    base = _base(model)
    if not is_moe(base):
        raise UserError(f"{flag}: {type(base).__name__} is not a mixture of experts (it has no router); drop "
                        "the flag or train a MoE model")
    tracker = _RouterLoss(base)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    # the decoder returns its router logits; the model around it does not compute its own router loss (it
    # would, with the config's output_router_logits, and fails on a KV-cache step's attention mask)
    decoder.register_forward_pre_hook(_with_router_logits, with_kwargs=True)
    decoder.register_forward_hook(tracker.capture, with_kwargs=True)
    setattr(base, _TRACKER, tracker)


@contextlib.contextmanager
def router_token_weights(model: torch.nn.Module, weights: torch.Tensor | None):
    """While inside, the router loss of `model`'s forwards weighs token (r, t) by `weights[r, t]` (shaped as
    the input ids) instead of using the attention mask: how many samples hold that token (0 for padding).
    None, or an untracked model: no change."""
    tracker = getattr(_base(model), _TRACKER, None)
    if tracker is None or weights is None:
        yield
        return
    tracker.weights = weights
    try:
        yield
    finally:
        tracker.weights = None


def take_router_loss(model: torch.nn.Module) -> torch.Tensor | None:
    """The load-balancing loss of `model`'s last forward (once: it is cleared), None when untracked or none
    ran."""
    tracker = getattr(_base(model), _TRACKER, None)
    return tracker.take() if tracker is not None else None
