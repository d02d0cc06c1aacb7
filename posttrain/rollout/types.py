"""The rollout contract: sampling parameters, one sampled completion, the engine protocol, seeds.

Token in, token out: prompts are token-id lists, outputs are exactly the sampled token ids with
one log-prob each, ``log softmax(logits / temperature)[token]`` of the FULL temperature-scaled
distribution (never renormalised after top-p), so that
``posttrain.algorithms.losses.token_logprobs(logits, labels, temperature)`` recomputed by the
trainer on the same weights gives the same numbers. Text is never re-tokenised.
"""
from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

FINISH_REASONS = ("stop", "length")


def _is_int(x) -> bool:
    """An integer (numpy integers included), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Invalid values raise ``ValueError`` naming the field.

    * ``temperature``: > 0 samples from ``softmax(logits / temperature)``; ``0`` means greedy
      (argmax), and the reported log-probs are then those of the unscaled distribution
      (temperature 1), since ``logits / 0`` is undefined.
    * ``top_p`` in (0, 1]: sample from the smallest set of most likely tokens whose probability
      mass reaches ``top_p`` (log-probs stay those of the full distribution).
    * ``max_new_tokens`` >= 1; ``n`` >= 1 samples per prompt.
    * ``seed``: None → a fresh seed drawn from torch's global RNG (so it follows the training
      seed); an int >= 0 → reproducible (same seed and inputs → identical outputs).
    * ``stop_token_ids``: None → the engine's eos ids (tokenizer + generation config; several
      allowed); a list → exactly these ids stop a sample (``[]`` → only ``max_new_tokens`` stops).
    * ``min_tokens`` >= 0: the stop ids cannot be sampled before a sample has this many tokens (or
      its budget, if smaller). Default 1, as OpenRLHF passes vLLM: a response is never empty. The
      recorded log-probs stay those of the full distribution (see ``sampling.sample_next``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 1

    def __post_init__(self):
        t = self.temperature
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 and t == t
                and t != float("inf")):
            raise ValueError(f"SamplingParams.temperature={t!r} must be a finite number > 0 (or 0 for "
                             f"greedy)")
        p = self.top_p
        if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p <= 1):
            raise ValueError(f"SamplingParams.top_p={p!r} must be in (0, 1]")
        if not (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not (_is_int(self.n) and self.n >= 1):
            raise ValueError(f"SamplingParams.n={self.n!r} must be an integer >= 1")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            raise ValueError(f"SamplingParams.min_tokens={self.min_tokens!r} must be an integer >= 0")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed={self.seed!r} must be None or an integer in [0, 2**63)")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise ValueError(f"SamplingParams.stop_token_ids={ids!r} must be None or a list of token ids")
            ids = tuple(ids)
            if not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"SamplingParams.stop_token_ids={list(ids)!r} must hold token ids >= 0")
            object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the log-probs refer to (1.0 when greedy)."""
        return float(self.temperature) if self.temperature > 0 else 1.0


@dataclass
class RolloutOutput:
    """One sampled completion of one prompt.

    ``output_token_ids`` are the sampled tokens as sampled: the stop token is included when the
    sample stopped, nothing is padded, truncated or rewritten. ``logprobs[i]`` is the log-prob of
    ``output_token_ids[i]`` (see module doc). ``finish_reason`` is "stop" (ended with a stop token)
    or "length" (``max_new_tokens`` reached without one). ``policy_versions[i]`` (None: not recorded)
    is the weights version (``weights_updated(version)``) that sampled ``output_token_ids[i]``: with
    partial rollout a sample may span several."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_versions: list[int] | None = None  # per output token: the weights version that sampled it

    def __post_init__(self):
        if len(self.logprobs) != len(self.output_token_ids):
            raise ValueError(f"RolloutOutput: {len(self.logprobs)} logprobs for "
                             f"{len(self.output_token_ids)} output tokens")
        if self.policy_versions is not None and len(self.policy_versions) != len(self.output_token_ids):
            raise ValueError(f"RolloutOutput: {len(self.policy_versions)} policy versions for "
                             f"{len(self.output_token_ids)} output tokens")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"RolloutOutput.finish_reason={self.finish_reason!r}: valid values are "
                             f"{list(FINISH_REASONS)}")

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class PromptImages:
    """One prompt's entry of ``generate(..., images=)`` (a vision-language model), in the two forms the
    engines take: ``tensors``, the processor's image tensors (numpy, ``pixel_values``, ``image_grid_thw``
    ...), which the HF engine feeds its model, and ``pil``, the images themselves (PIL, in prompt order),
    which vLLM takes (it runs the processor itself). Either way the prompt ids hold the EXPANDED image
    tokens, as the trainer sees them. A bare dict in ``images`` is the tensors alone (``tensors_of``)."""

    tensors: dict | None = None
    pil: list | None = None

    @staticmethod
    def tensors_of(entry) -> dict | None:
        """An ``images`` entry's tensors: the entry itself when it is a dict (or None)."""
        return entry.tensors if isinstance(entry, PromptImages) else entry

    @staticmethod
    def pil_of(entry) -> list | None:
        """An ``images`` entry's raw images (None: it has none; a bare dict of tensors has none)."""
        if isinstance(entry, PromptImages):
            return None if entry.pil is None else list(entry.pil)
        return None


def check_budgets(max_new_tokens, num_prompts: int, params: SamplingParams) -> list[int]:
    """Per-prompt generation budgets: ``params.max_new_tokens`` for every prompt when
    ``max_new_tokens`` is None, else the given list (one int >= 1 per prompt)."""
    if max_new_tokens is None:
        return [params.max_new_tokens] * num_prompts
    budgets = list(max_new_tokens)
    if len(budgets) != num_prompts:
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {num_prompts} prompts")
    bad = [b for b in budgets if not (_is_int(b) and b >= 1)]
    if bad:
        raise ValueError(f"max_new_tokens holds {bad[0]!r}; every budget must be an integer >= 1")
    return [int(b) for b in budgets]


@runtime_checkable
class RolloutEngine(Protocol):
    """What a trainer needs from a sampler.

    ``generate`` returns one list of ``params.n`` outputs per prompt, in prompt order; its optional
    ``max_new_tokens`` (one budget per prompt) overrides ``params.max_new_tokens``.
    ``load_weights(model_or_state_dict)`` copies policy weights into the engine; ``sync_weights(model)``
    makes the engine sample with ``model``'s current weights (a no-op when the engine shares the
    module). ``sleep()`` / ``wake_up()`` release / reacquire accelerator memory between rollouts
    (no-ops in process).

    Weight sync, bucket by bucket: ``update_weights(pairs)`` copies HF-named base tensors;
    ``update_adapter(pairs)`` applies LoRA adapter tensors under their canonical names
    (``{module}.lora_A.weight`` / ``.lora_B.weight``, ``posttrain.models.lora_sync``) in the engine's
    ``lora_sync`` mode ("merged": ``W = W0 + s·B·A`` from pristine copies; "adapter": the engine's own
    LoRA support); ``weights_updated(version)`` ends a sync. ``weights_hash()`` (None where the engine
    cannot hash its weights) is ``lora_weights_hash`` of base + adapter + scaling for a LoRA policy."""

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 max_new_tokens: list[int] | None = None,
                 seeds: list[int] | None = None) -> list[list[RolloutOutput]]: ...

    def load_weights(self, model_or_state_dict) -> None: ...

    def sync_weights(self, model) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...


def rank_seed(base_seed: int, rank: int, step: int) -> int:
    """A sampling seed in [0, 2**63) for (``base_seed``, ``rank``, ``step``): 63 bits of
    SHA-256 over the three integers, so different ranks (or steps) never share a seed in
    practice (a collision has probability ~2**-63) and a run is reproducible from ``base_seed``."""
    for name, v in (("base_seed", base_seed), ("rank", rank), ("step", step)):
        if not _is_int(v) or v < 0:
            raise ValueError(f"rank_seed: {name}={v!r} must be an integer >= 0")
    digest = hashlib.sha256(f"posttrain-rollout:{base_seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
