"""In-process rollout engine over a transformers causal LM (the training module itself, no copy).

Sampling runs in our own decode loop over the model's KV cache (`decode_batch.DecodeBatch`), so that
log-probs, top-p, seeding and stopping are ours:

* prompts are left-padded; ``attention_mask`` marks real tokens and ``position_ids`` are
  ``cumsum(mask) - 1``, so each row sees positions 0..L-1 exactly as if it ran alone;
* each step samples one token per row (``sample_next``); a row stops at its first stop token
  (kept in the output; never before ``params.min_tokens`` tokens) or after its budget; finished rows leave the
  batch and the cache, and waiting rows join it between decode steps (continuous batching, at
  most ``batch_size`` rows);
* every sample draws from its own ``torch.Generator``, seeded from its prompt's seed (``seeds[i]``,
  else ``rank_seed(params.seed, 0, i)``) and its index j: a prompt's samples do not depend on the
  other prompts, its position, the ``batch_size`` or how prompts are split across engines.

``stream()`` serves single requests from other threads on the same loop (``stream.DecodeServer``):
that is what the async front (``async_engine``) uses for agent episodes.

The engine composes two parts: ``hf_weights.HFWeights`` (loads, bucketed syncs, and a LoRA policy's
adapter-only sync in one of two ``lora_sync`` modes, ``merged`` or ``adapter``) and ``pause.PauseGate`` (one
decode step at a time, weight loads between them).

Weights may change while samples are in flight (partial rollout): a load waits for the decode step in
flight (``paused()``), and the rows in flight are re-prefilled with the new weights before their next
token; every token records the ``weight_version`` that sampled it (``RolloutOutput.policy_versions``).
"""
from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from contextlib import contextmanager

import torch

from posttrain.models import unwrap_model
from posttrain.models.vision import is_vision_model
from posttrain.rollout.cpu.fast_decode import KVBuffer, fast_decoder
from posttrain.rollout.decode_batch import DecodeBatch, Sequence
from posttrain.rollout.hf_weights import HFWeights
from posttrain.rollout.pause import PauseGate
from posttrain.rollout.sampling import check_seeds, sample_generators
from posttrain.rollout.types import (
    PromptImages,
    RolloutOutput,
    SamplingParams,
    _is_int,
    check_budgets,
    rank_seed,
)
from posttrain.rollout.vision_decode import decode_with_images


def _as_id_list(ids) -> list[int]:
    if ids is None:
        return []
    if _is_int(ids):
        return [ids]
    return [int(i) for i in ids]


def resolve_eos_ids(tokenizer_or_eos_ids, model=None) -> list[int]:
    """Default stop ids: an int or a list of ints as given; a tokenizer → its ``eos_token_id``
    plus the model's ``generation_config.eos_token_id`` (int or list), deduplicated in order."""
    if (tokenizer_or_eos_ids is None or _is_int(tokenizer_or_eos_ids)
        or isinstance(tokenizer_or_eos_ids, (list, tuple))):
        ids = _as_id_list(tokenizer_or_eos_ids)
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"tokenizer_or_eos_ids={tokenizer_or_eos_ids!r}: eos ids must be integers >= 0")
        return list(dict.fromkeys(ids))
    if not hasattr(tokenizer_or_eos_ids, "eos_token_id"):
        raise ValueError(f"tokenizer_or_eos_ids must be a tokenizer, an eos id or a list of eos ids, "
                         f"not {type(tokenizer_or_eos_ids).__name__}")
    ids = _as_id_list(tokenizer_or_eos_ids.eos_token_id)
    gen_cfg = getattr(unwrap_model(model), "generation_config", None) if model is not None else None
    ids += _as_id_list(getattr(gen_cfg, "eos_token_id", None))
    return list(dict.fromkeys(ids))


def _hf_model(model):
    base = unwrap_model(model)
    return base.get_base_model() if hasattr(base, "peft_config") else base


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=_hf_model(model).config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


class HFRolloutEngine:
    """``RolloutEngine`` over an in-process transformers model.

    ``model`` is shared, not copied: rollouts always use its current weights. It runs under
    ``torch.no_grad()`` in eval mode and every submodule's train/eval flag is restored after each
    ``generate``. ``tokenizer_or_eos_ids`` gives the default stop ids (see ``resolve_eos_ids``);
    ``pad_token_id`` fills the left padding; ``batch_size`` caps the rows (prompts × n) per
    forward batch (None → all rows in one batch). ``lora`` (a ``LoraSpec``-like, None/rank 0: off) and
    ``lora_sync`` ("merged" or "adapter", `hf_weights`): how a synced LoRA adapter is applied."""

    def __init__(self, model: torch.nn.Module, tokenizer_or_eos_ids, *, pad_token_id: int,
                 batch_size: int | None = None, fast_decode: bool = True, lora=None,
                 lora_sync: str = "merged"):
        self.gate = PauseGate()  # one decode step at a time; a weight load waits for the step in flight
        self.weights = HFWeights(model, self.gate, lora, lora_sync)  # wraps the model in peft in adapter mode
        self.model = self.weights.model
        self.eos_token_ids = resolve_eos_ids(tokenizer_or_eos_ids, self.model)
        self.vocab_size = _hf_model(self.model).get_input_embeddings().num_embeddings
        if not (_is_int(pad_token_id) and 0 <= pad_token_id < self.vocab_size):
            raise ValueError(f"pad_token_id={pad_token_id!r} must be a token id in [0, {self.vocab_size})")
        if batch_size is not None and not (_is_int(batch_size) and batch_size >= 1):
            raise ValueError(f"batch_size={batch_size!r} must be None or an integer >= 1")
        self.pad_token_id = int(pad_token_id)
        self.batch_size = batch_size
        params = inspect.signature(_hf_model(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.x / 4.x
        self._keep_kw = "logits_to_keep" in params
        # decode steps skip transformers' module machinery where the architecture allows (fast_decode)
        self._fast = fast_decoder(_hf_model(self.model)) if fast_decode else None
        self.vision = is_vision_model(self.model)  # generates through `vision_decode` (module doc there)

    # -- weights (`hf_weights.HFWeights`) and the pause protocol (`pause.PauseGate`) --------------
    @property
    def lora_sync(self) -> str | None:
        return self.weights.lora_sync

    @property
    def weight_version(self) -> int:
        return self.weights.version

    def load_weights(self, model_or_state_dict) -> int:
        """Copy weights into the engine's model (a state dict, or another module's; from a peft module:
        its base weights and its adapter); no-op when given the engine's own module. Returns the bytes
        copied."""
        return self.weights.load(model_or_state_dict)

    def release_decode_weights(self) -> None:
        """Free the fast decode path's fused weight copies until the next decode (`FastDecoder.release`):
        the in-process trainer calls it after each rollout of the module it trains."""
        if self._fast is not None:
            self._fast.release()

    def sync_weights(self, model) -> int:
        """Sample with ``model``'s current weights; returns the bytes copied (0 when it is the shared
        module). From a peft module only the adapter moves (the base is the engine's since the load)."""
        return self.weights.sync(model)

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy some HF-named weights (one sync bucket) into the engine's model. In merged LoRA mode a
        targeted weight replaces ``W0`` and is merged again with the current adapter."""
        self.weights.update(named)

    def update_adapter(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Apply LoRA adapter tensors (canonical names ``{module}.lora_A.weight`` / ``.lora_B.weight``,
        ``models.lora_sync``; one sync bucket) in this engine's ``lora_sync`` mode; returns their bytes."""
        return self.weights.update_adapter(pairs)

    def weights_updated(self, version: int | None = None) -> None:
        """After the last bucket of a sync: tokens sampled from now on record ``version`` (the trainer's
        policy version; None: unchanged). Hold ``paused()`` over the whole sync when generation runs
        concurrently, so no token is sampled from half-loaded weights."""
        self.weights.updated(version)

    def paused(self):
        """A context in which no decode step runs (those in flight continue afterwards, re-prefilled with
        the weights loaded meanwhile): partial rollout's weight sync holds it. It gets the engine at the
        next step boundary; the thread inside may still generate (`pause.PauseGate`)."""
        return self.gate.paused()

    def decode_step(self):
        """Hold the engine for one decode step (admit + step), after any weight load waiting in `paused`."""
        return self.gate.step()

    def _weights(self) -> tuple[int, int]:
        return self.weights.epoch, self.weights.version

    def weights_hash(self) -> str:
        """`posttrain.utils.weights_hash` of the weights the engine samples with; with LoRA
        `lora_sync.lora_weights_hash` of base (``W0``) + adapter + scaling, as the trainer's."""
        return self.weights.hash()

    def sleep(self) -> None:
        """No-op: the in-process engine holds no memory of its own between calls."""

    def wake_up(self) -> None:
        """No-op (see ``sleep``)."""

    # -- generation ----------------------------------------------------------------------------
    def stop_ids(self, params: SamplingParams) -> list[int]:
        return list(params.stop_token_ids) if params.stop_token_ids is not None else list(self.eos_token_ids)

    def generate(self, prompt_token_ids: Seq[Seq[int]], params: SamplingParams,
                 max_new_tokens: Seq[int] | None = None,
                 seeds: Seq[int] | None = None,
                 images: Seq[dict | PromptImages | None] | None = None) -> list[list[RolloutOutput]]:
        """One list of ``params.n`` outputs per prompt; the n samples of a prompt are sampled as
        consecutive rows (group-contiguous) and returned in that order. ``max_new_tokens`` (one
        int >= 1 per prompt) overrides ``params.max_new_tokens`` prompt by prompt; a sample that
        reaches its own budget finishes with "length". ``seeds`` (one int in [0, 2**63) per prompt)
        gives each prompt its seed; None → ``rank_seed(params.seed, 0, i)`` for prompt i (a base
        seed drawn from torch's global RNG when ``params.seed`` is None). Sample j of prompt i
        draws only from a generator seeded with ``rank_seed(seed_i, 1, j)``. ``images`` (a vision-language
        model: one dict of image tensors, a ``PromptImages`` (its tensors are used) or None per prompt,
        `data.vision_samples`; the prompt ids hold their image tokens) decodes through `vision_decode`
        instead, in static batches of ``batch_size`` rows."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, not {type(params).__name__}")
        prompts = self._check_prompts(prompt_token_ids)
        prompt_seeds = check_seeds(seeds, len(prompts))
        if not prompts:
            return []
        budgets = check_budgets(max_new_tokens, len(prompts), params)
        sequences = self.sequences(prompts, params, budgets, prompt_seeds)
        with self.inference():
            tensors = None if images is None else [PromptImages.tensors_of(im) for im in images]
            if self.vision:  # text-only rows too: the image-structure tokens must never be sampled
                tensors = tensors if tensors is not None else [None] * len(prompts)
                self._decode_with_images(sequences, [im for im in tensors for _ in range(params.n)])
            elif tensors is not None and any(im is not None for im in tensors):
                raise ValueError("images were given for a model that is not a vision-language model")
            else:
                self.run_to_completion(sequences)
        flat = [s.output() for s in sequences]
        return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    def sequences(self, prompts: list[list[int]], params: SamplingParams, budgets: list[int],
                  prompt_seeds: list[int] | None) -> list[Sequence]:
        """The ``params.n`` samples of each (checked) prompt as decode-batch sequences, group-contiguous,
        each with its budget and its own generator (seeding as ``generate`` documents)."""
        if prompt_seeds is None:
            base = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, (1,)).item())
            prompt_seeds = [rank_seed(base, 0, i) for i in range(len(prompts))]
        generators = iter(sample_generators(prompt_seeds, params.n))
        stop = frozenset(self.stop_ids(params))
        return [Sequence(prompt=p, limit=b, temperature=float(params.temperature), top_p=float(params.top_p),
                         stop=stop, generator=next(generators), min_tokens=params.min_tokens)
                for p, b in zip(prompts, budgets) for _ in range(params.n)]

    def stream(self, max_rows: int | None = None):
        """A ``stream.DecodeServer``: requests submitted from any thread join the running decode batch."""
        from posttrain.rollout.stream import DecodeServer

        return DecodeServer(self, max_rows)

    def decode_batch(self) -> DecodeBatch:
        fast = self._fast is not None and self._fast.usable()
        adopt = KVBuffer.from_cache if fast else (lambda cache: cache)
        return DecodeBatch(self._forward, lambda: _new_cache(self.model), self.pad_token_id,
                           next(self.model.parameters()).device, self._weights, adopt)

    def run_to_completion(self, sequences: list[Sequence]) -> None:
        """Decode every sequence to its end, at most ``batch_size`` rows at a time: a sequence joins the
        batch as soon as finished rows leave it (continuous batching; at batch boundaries for a model
        whose cache cannot merge, see ``decode_batch``). Call inside ``inference()``."""
        pending = deque(sequences)
        batch = self.decode_batch()
        cap = self.batch_size or len(sequences)
        while pending or len(batch):
            with self.decode_step():  # a weight load (partial rollout) happens between steps
                batch.admit_waiting(pending, cap)
                batch.step()

    def _decode_with_images(self, sequences: list[Sequence], images: list[dict | None]) -> None:
        if len(images) != len(sequences):
            raise ValueError(f"images: {len(images)} entries for {len(sequences)} rows (one per prompt "
                             f"expected)")
        cap = self.batch_size or len(sequences)
        for start in range(0, len(sequences), cap):
            with self.decode_step():
                decode_with_images(self.model, lambda: _new_cache(self.model), sequences[start:start + cap],
                                   images[start:start + cap], self.pad_token_id, self._cache_kw,
                                   self._keep_kw, self.weight_version)

    @contextmanager
    def inference(self):
        """``torch.no_grad()`` and eval mode, every submodule's train/eval flag restored afterwards."""
        training = [m for m in self.model.modules() if m.training]
        if training:
            self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for m in training:
                m.training = True

    def _check_prompts(self, prompt_token_ids) -> list[list[int]]:
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise ValueError("prompt_token_ids must be a list of token-id lists")
        prompts = []
        for i, p in enumerate(prompt_token_ids):
            if isinstance(p, torch.Tensor):
                p = p.tolist()
            if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
                raise ValueError(f"prompt_token_ids[{i}] must be a list of token ids, not {type(p).__name__}")
            p = list(p)
            if not p:
                raise ValueError(f"prompt_token_ids[{i}] is empty; every prompt needs at least one token")
            if not all(_is_int(t) and 0 <= t < self.vocab_size for t in p):
                bad = next(t for t in p if not (_is_int(t) and 0 <= t < self.vocab_size))
                raise ValueError(f"prompt_token_ids[{i}] holds {bad!r}; token ids must be integers in "
                                 f"[0, {self.vocab_size})")
            prompts.append([int(t) for t in p])
        return prompts

    def _forward(self, input_ids, attention_mask, position_ids, cache, last_only: bool):
        if isinstance(cache, KVBuffer):  # a decode step (one token per row) on the fast path
            return self._fast.step(input_ids[:, 0], attention_mask, position_ids[:, 0], cache)
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  self._cache_kw: cache, "use_cache": True}
        if last_only and self._keep_kw:
            kwargs["logits_to_keep"] = 1
        return self.model(**kwargs).logits[:, -1].float()
