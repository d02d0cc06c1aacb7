"""The models of an RL run, each a role object that owns its model and train engine and exposes the
batch methods the RL loop needs — the loop calls only these, so another placement (Ray actor
groups) can implement the same methods without changing the loop:

- `Actor` (trained policy): `logprobs`, `fit`, `save_state` / `load_state`, `export`,
  `broadcast_weights(engines)`, EMA of its (trainable) weights; a LoRA actor also `reference_logprobs`
  (its base, adapter disabled) and syncs base + adapter once, then the adapter only (`models.lora_sync`);
- `Reference` (frozen policy): `logprobs`; `AdapterOffReference`: the same from a LoRA actor's base;
- `Critic` (trained value model): `values`, `fit`, `save_state` / `load_state`, `export`.

A role's state directory holds its engine state (weights, optimizer, scheduler) plus its own extras
(the actor's EMA), so a checkpoint is one directory per role."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path

import torch

from posttrain.models import (
    is_peft,
    merge_lora,
    save_pretrained,
    tied_lora_layers,
    trainable_names,
    unwrap_model,
)
from posttrain.models import lora_sync as lsync
from posttrain.trainers.rl.batch_forward import Batching, policy_forward, to_device, value_forward
from posttrain.trainers.rl.experience import Experience
from posttrain.trainers.rl.updates import UpdateSettings, lockstep, update_actor, update_critic
from posttrain.utils.checkpoint import load_state_file
from posttrain.utils.log import warn_once
from posttrain.utils.weights_hash import weights_hash

EMA_FILE = "ema.pt"


class _Scorer:
    """A role's model on `device`. `context`: its context-parallel groups
    (`models.parallel_groups.ContextGroups`: rows split over a group), or None; `loaded_numel`: (parameter
    elements this rank held once loaded, elements of the whole model), or None when not known (both from
    `models.setup.BuiltModel`)."""
    engine = None  # a train engine (collective forwards under ZeRO-3), or None for a frozen model

    def __init__(self, model, device, context=None, loaded_numel: tuple[int, int] | None = None) -> None:
        self.model = model
        self.device = device
        self.context = context
        self.loaded_numel = loaded_numel

    def _per_token(self, exp: Experience, batches: Batching, fn) -> torch.Tensor:
        """`fn` over the micro-batches of `exp`, masked per token, `[B, T-1]`. Under data parallelism
        every rank runs the same number of forwards (`lockstep`), as ZeRO-3 needs."""
        out = torch.zeros_like(exp.action_mask)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for rows in lockstep(self.engine, batches.micro_batches(exp)):
                part = exp.select(rows or [0])
                result = fn(to_device(part, self.device)).float().cpu() * part.action_mask
                if rows:
                    out[rows, : part.action_mask.shape[1]] = result
        self.model.train(was_training)
        return out


def sharded_weights(engine) -> dict | None:
    """The full weights gathered on rank 0 under ZeRO-3 or tensor parallelism (collective), else None: the
    module's own tensors are whole."""
    split = getattr(engine, "zero_stage", None) == 3 or getattr(engine, "tensor_parallel", 1) > 1
    return engine.full_state_dict() if split else None


class Actor(_Scorer):
    """The trained policy. With `ema_beta`, an exponential moving average of its weights is kept
    (`ema ← β·ema + (1-β)·θ` after every optimizer step, as OpenRLHF) for the exports: of every
    weight, or of a LoRA actor's adapters only (its base is frozen). `base_path`: the folder the
    actor was loaded from, and `dtype` its weights' (merged exports of a LoRA actor, `--ckpt.save_merged`);
    `lora_sync`: how the rollout engines apply a LoRA actor's adapter (--vllm.lora_sync); `sync_only`: the
    weights a full-parameter sync sends (None: all; a frozen vision tower stays as the engines loaded it);
    `context`, `loaded_numel` as `_Scorer`'s."""

    def __init__(self, model, engine, temperature: float, device, ema_beta: float | None = None,
                 base_path: str | None = None, save_merged: bool = False, dtype: str = "fp32",
                 lora_sync: str = "merged", sync_only: Callable[[str], bool] | None = None, context=None,
                 loaded_numel: tuple[int, int] | None = None) -> None:
        super().__init__(model, device, context, loaded_numel)
        self.engine = engine
        self.temperature = temperature
        self.ema_beta = ema_beta
        self.peft = is_peft(model)
        self.scaling = lsync.scaling(unwrap_model(model)) if self.peft else None
        self.lora_sync = lora_sync
        self.base_path, self.save_merged, self.dtype = base_path, save_merged and self.peft, dtype
        self.sync_only = sync_only
        self.ema = None
        if ema_beta is not None:
            self.ema = self._ema_start()

    def _ema_start(self) -> dict[str, torch.Tensor]:
        keep = trainable_names(self.model) if self.peft else None
        return {k: v.detach().clone().float() for k, v in self.model.state_dict().items()
                if keep is None or k in keep}

    @property
    def keeps_ema(self) -> bool:
        return self.ema is not None

    def logprobs(self, exp: Experience, batches: Batching) -> torch.Tensor:
        return self._per_token(exp, batches,
                               lambda part: policy_forward(self.engine.model, part, self.temperature,
                                                           context=self.context, **batches.layout)[0])

    def reference_logprobs(self, exp: Experience, batches: Batching) -> torch.Tensor:
        """`logprobs` of a LoRA actor's base weights (adapter disabled): the reference of a run whose
        reference starts from the actor's weights, without a second copy."""
        with unwrap_model(self.engine.model).disable_adapter():
            return self.logprobs(exp, batches)

    def fit(self, exp: Experience, settings: UpdateSettings, kl_coef: float, step: int,
            step_rows=None, weights_out: dict | None = None) -> dict[str, float]:
        """`settings.max_epochs` passes of optimizer steps over `exp` (`updates.update_actor`);
        `step_rows`: a data-parallel rank's rows of each step."""
        return update_actor(self, exp, settings, kl_coef, step, step_rows, weights_out)

    def update_ema(self) -> None:
        if self.ema is None:
            return
        beta = self.ema_beta
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                if k in self.ema:
                    self.ema[k].mul_(beta).add_(v.float(), alpha=1 - beta)

    def ema_state_dict(self) -> dict | None:
        """The EMA weights in the model's own dtypes (None without EMA)."""
        if self.ema is None:
            return None
        dtypes = {k: v.dtype for k, v in self.model.state_dict().items()}
        return {k: v.to(dtypes[k]) for k, v in self.ema.items()}

    def save_state(self, directory: Path) -> None:
        """Weights, optimizer, scheduler (the engine's state: every rank's part) and the EMA into
        `directory`; collective under data parallelism."""
        self.engine.save_state(directory)
        if self.ema is not None and self.engine.is_main:
            torch.save(self.ema, Path(directory) / EMA_FILE)

    def load_state(self, directory: Path) -> None:
        """The state `save_state` wrote. With the EMA kept but no `ema.pt` in `directory`, the EMA
        restarts from the loaded weights, with a warning — never silently from the initial ones."""
        self.engine.load_state(directory)
        if self.ema is None:
            return
        if (Path(directory) / EMA_FILE).exists():
            self.ema = load_state_file(Path(directory) / EMA_FILE)
        else:
            warn_once(f"checkpoint {directory} holds no EMA weights; the EMA restarts from the resumed "
                      "weights")
            self.ema = self._ema_start()

    def export(self, directory: Path, tokenizer, ema: bool = True) -> None:
        """A `from_pretrained`-loadable policy in `directory` (the EMA weights when kept and `ema`); a
        LoRA actor writes its adapter (PEFT format), and with `save_merged` also the merged model in
        `directory/merged`. Collective under ZeRO-3 (the full weights are gathered), written by rank 0."""
        state = self.ema_state_dict() if ema and self.ema is not None else sharded_weights(self.engine)
        if self.engine.is_main:
            save_pretrained(self.model, tokenizer, directory, state_dict=state)
            if self.save_merged:
                merge_lora(directory, Path(directory) / "merged", base_path=self.base_path, dtype=self.dtype)

    def sync_pairs(self, kind: str = "full", per_tensor: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """What a rollout engine with its own copy takes, as `(name, CPU tensor)` pairs on rank 0, gathered
        all at once or one tensor at a time (`TrainEngine.full_weights`: every rank must exhaust them,
        collective under ZeRO-3). A full-parameter actor: every weight ("full": the first, verified sync), or
        those `sync_only` keeps ("trained": a frozen vision tower is left out). A LoRA actor: under the
        canonical names of `models.lora_sync`; `kind` "full": base + adapter (the first, verified sync),
        "adapter": the adapter tensors only (only they are gathered)."""
        if not self.peft:
            return self.engine.full_weights(per_tensor, keep=self.sync_only if kind == "trained" else None)
        self._check_lora_sync()
        if kind == "adapter":
            return lsync.canonical_pairs(self.engine.full_weights(True, keep=lsync.is_peft_adapter_name))
        return lsync.canonical_pairs(self.engine.full_weights(per_tensor))

    def _check_lora_sync(self) -> None:
        if getattr(unwrap_model(self.model), "is_loaded_in_4bit", False):
            raise ValueError("a QLoRA actor (--ds.load_in_4bit) cannot sync to rollout engines with their "
                             "own copy yet: run in one process without --train.async_enable (the engine "
                             "samples from the actor)")
        tied = tied_lora_layers(self.model) if self.lora_sync == "merged" else []
        if tied:
            raise ValueError(f"LoRA on {tied[0]}, whose weight is tied to the input embeddings, cannot be "
                             "merged by a rollout engine (--vllm.lora_sync merged): use --vllm.lora_sync "
                             "adapter, or leave the "
                             "output head out of --ds.lora.target_modules")

    def weights_hash(self, per_tensor: bool = False) -> str | None:
        """What a synced engine must hold (rank 0; None elsewhere; collective under ZeRO-3): `weights_hash`
        of the weights, or for a LoRA actor `lora_sync.lora_weights_hash` (base + adapter + scaling)."""
        named = self.sync_pairs("full", per_tensor)
        digest = lsync.lora_weights_hash(named, [], self.scaling) if self.peft else weights_hash(named)
        return digest if self.engine.is_main else None

    def broadcast_weights(self, engines, verify: bool = False, version: int | None = None) -> int:
        """Make every rollout engine sample with the current weights (a no-op for an engine that
        shares this module in process; nothing to verify then); `version` (the policy version, async
        RL): recorded by the engine for the tokens it samples from now on. An engine with `paused()`
        takes the weights between two decode steps (partial rollout). A LoRA actor sends base + adapter
        with `verify` (the first sync), else the adapter only. Returns the bytes copied."""
        sent = 0
        for engine in engines:
            own_copy = getattr(engine, "model", None) is not unwrap_model(self.model)
            if self.peft and own_copy:
                self._check_lora_sync()
            with engine.paused() if hasattr(engine, "paused") else nullcontext():
                load = engine.load_weights if self.peft and own_copy and verify else engine.sync_weights
                sent += load(self.model) or 0
                if version is not None:
                    engine.weights_updated(version)
        return sent


class Reference(_Scorer):
    """The frozen reference policy: a whole copy (`offload`: moved to CPU memory between forwards, where
    there is an accelerator), or this rank's ZeRO-3 shards (`engine`: an `engines.zero3.FrozenShards`, whose
    forwards are collective, so every rank of the group runs as many; its own offload is DeepSpeed's).
    `context`, `loaded_numel` as `_Scorer`'s."""

    def __init__(self, model, temperature: float, device, offload: bool = False, engine=None, context=None,
                 loaded_numel: tuple[int, int] | None = None) -> None:
        super().__init__(model, device, context, loaded_numel)
        self.engine = engine
        self.temperature = temperature
        self.offload = offload and device.type != "cpu" and engine is None
        if self.offload:
            self.model.to("cpu")

    def logprobs(self, exp: Experience, batches: Batching) -> torch.Tensor:
        if self.offload:
            self.model.to(self.device)
        try:
            return self._per_token(exp, batches, lambda part: policy_forward(
                self.model, part, self.temperature, context=self.context, **batches.layout)[0])
        finally:
            if self.offload:
                self.model.to("cpu")


class AdapterOffReference:
    """The reference of a LoRA run whose reference starts from the actor's weights: the actor's base
    with its adapter disabled (`Actor.reference_logprobs`, or an actor group's on Ray)."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def logprobs(self, exp: Experience, batches: Batching) -> torch.Tensor:
        return self.actor.reference_logprobs(exp, batches)


class Critic(_Scorer):
    """The value model. With `normalize` (--reward.normalize_enable) its values are
    `(v - mean) / std` with the mean/std stored in its config (a critic started from a reward model
    trained by `posttrain rm` carries them; OpenRLHF's critic does the same); without them, unchanged."""

    def __init__(self, model, engine, device, normalize: bool = False, context=None,
                 loaded_numel: tuple[int, int] | None = None) -> None:
        super().__init__(model, device, context, loaded_numel)
        self.engine = engine
        config = getattr(model, "config", None)
        mean, std = getattr(config, "mean", None), getattr(config, "std", None)
        known = normalize and mean is not None and std
        self.mean, self.std = (float(mean), float(std)) if known else (0.0, 1.0)
        if normalize and (mean is None or not std):
            warn_once("--reward.normalize_enable: the critic's model has no reward mean/std in its config "
                      "(it was not started from a reward model trained by posttrain rm), so its values are "
                      "not normalised")

    def values(self, exp: Experience, batches: Batching) -> torch.Tensor:
        return self._per_token(exp, batches, lambda part: self.forward(part, batches))

    def forward(self, part: Experience, batches: Batching | None = None) -> torch.Tensor:
        """Value of each state before an action: V(tokens ≤ t) in column t, `[b, T-1]` (normalised),
        in `batches`' layout (None: padded)."""
        layout = batches.layout if batches is not None else {}
        return (value_forward(self.engine.model, part, context=self.context, **layout) - self.mean) / self.std

    def fit(self, exp: Experience, settings: UpdateSettings, step: int, step_rows=None,
            weights_out: dict | None = None) -> dict[str, float]:
        return update_critic(self, exp, settings, step, step_rows, weights_out)

    def save_state(self, directory: Path) -> None:
        self.engine.save_state(directory)

    def load_state(self, directory: Path) -> None:
        self.engine.load_state(directory)

    def export(self, directory: Path, tokenizer) -> None:
        state = sharded_weights(self.engine)
        if self.engine.is_main:
            save_pretrained(self.model, tokenizer, directory, state_dict=state)
