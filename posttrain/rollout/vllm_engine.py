"""``RolloutEngine`` over vLLM's offline ``LLM`` (GPU only; ``pip install 'posttrain[vllm]'``).

vLLM is imported lazily, inside the class. Prompts go in as token ids (``{"prompt_token_ids":
ids}``, vLLM's ``TokensPrompt``); each prompt gets ``SamplingParams(n, temperature, top_p,
max_tokens, seed, logprobs=0, ...)``, with ``logprobs=0`` returning the sampled token's log-prob.
Each prompt is its own request with its own seed (``seeds[i] % 2**31`` when ``generate`` is given
``seeds``, else derived from ``params.seed`` and i), so its samples do not depend on the other prompts.

Log-probs: the engine is built with ``logprobs_mode="processed_logprobs"``, i.e. after
temperature, which equals our contract ``log softmax(logits / T)[token]`` when ``top_p == 1``
(vLLM's default "raw_logprobs" would be the temperature-1 values). With ``top_p < 1`` vLLM
renormalises over the nucleus, so its log-probs are higher than the trainer's recomputation by
``-log(nucleus mass)``; a warning says so once. Greedy (temperature 0): temperature-1 log-probs.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import torch

from posttrain.config.backends import VLLM_MISSING
from posttrain.models import unwrap_model
from posttrain.rollout.sampling import check_seeds
from posttrain.rollout.types import (
    FINISH_REASONS,
    RolloutOutput,
    SamplingParams,
    check_budgets,
    rank_seed,
)
from posttrain.utils.log import warn_once


def import_vllm():
    """The ``vllm`` module, or ImportError with the install hint."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_MISSING) from err
    return vllm


def _sampled_logprob(entry, token_id: int, where: str) -> float:
    """The sampled token's log-prob from one position of vLLM's ``CompletionOutput.logprobs``:
    a mapping ``{token_id: Logprob(logprob=...)}`` (or a bare float)."""
    if not isinstance(entry, Mapping) or token_id not in entry:
        raise ValueError(f"{where}: vLLM returned no log-prob for the sampled token {token_id}; "
                         "pass SamplingParams(logprobs=0)")
    value = entry[token_id]
    return float(getattr(value, "logprob", value))


def convert_vllm_outputs(prompt_token_ids: Sequence[Sequence[int]], request_outputs, n: int) -> list[list[RolloutOutput]]:
    """vLLM ``RequestOutput`` list (one per prompt, in order) → one list of ``n`` RolloutOutputs per
    prompt. Uses ``outputs[i].token_ids``, ``.logprobs`` (one ``{token_id: Logprob}`` per token),
    ``.finish_reason`` and ``.index`` (samples sorted by it); token ids are taken as returned."""
    if len(request_outputs) != len(prompt_token_ids):
        raise ValueError(f"vLLM returned {len(request_outputs)} request outputs for {len(prompt_token_ids)} prompts")
    result = []
    for p, (prompt, req) in enumerate(zip(prompt_token_ids, request_outputs)):
        completions = sorted(req.outputs, key=lambda c: getattr(c, "index", 0))
        if len(completions) != n:
            raise ValueError(f"prompt {p}: vLLM returned {len(completions)} samples, expected n={n}")
        group = []
        for c in completions:
            where = f"prompt {p} sample {getattr(c, 'index', '?')}"
            tokens = [int(t) for t in c.token_ids]
            if c.logprobs is None or len(c.logprobs) != len(tokens):
                raise ValueError(f"{where}: vLLM returned {0 if c.logprobs is None else len(c.logprobs)} "
                                 f"log-prob entries for {len(tokens)} tokens; pass SamplingParams(logprobs=0)")
            if c.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"{where}: vLLM finished the sample with finish_reason={c.finish_reason!r} "
                                   f"(expected one of {list(FINISH_REASONS)})")
            logprobs = [_sampled_logprob(e, t, where) for e, t in zip(c.logprobs, tokens)]
            group.append(RolloutOutput(list(prompt), tokens, logprobs, c.finish_reason))
        result.append(group)
    return result


class VLLMRolloutEngine:
    """``llm_or_model_path``: a ``vllm.LLM`` built by the caller (build it with
    ``logprobs_mode="processed_logprobs"``), or a model folder to build one with ``llm_kwargs``.
    ``eos_token_ids``: default stop ids (None → vLLM's own eos handling: tokenizer + generation
    config). Per-prompt seeds are ``seeds[prompt] % 2**31`` when ``generate`` gets ``seeds``, else derived
    from ``params.seed`` (``rank_seed(seed, 0, prompt) % 2**31``) so duplicate prompts in one batch still
    get different samples."""

    def __init__(self, llm_or_model_path, eos_token_ids: Sequence[int] | None = None, **llm_kwargs):
        if isinstance(llm_or_model_path, (str, os.PathLike)):
            vllm = import_vllm()
            llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
            llm_kwargs.setdefault("generation_config", "vllm")  # no sampling defaults from the model folder
            self.llm = vllm.LLM(model=str(llm_or_model_path), **llm_kwargs)
        else:
            self.llm = llm_or_model_path
        self.eos_token_ids = None if eos_token_ids is None else [int(i) for i in eos_token_ids]

    def vllm_sampling_params(self, params: SamplingParams, prompt_index: int, max_new_tokens: int | None = None,
                             seed: int | None = None):
        """vLLM ``SamplingParams`` for prompt ``prompt_index``; ``seed`` (the prompt's seed, in
        [0, 2**63)) → ``seed % 2**31``, None → ``rank_seed(params.seed, 0, prompt_index) % 2**31``
        (None when ``params.seed`` is None: vLLM draws)."""
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids
        if seed is None and params.seed is not None:
            seed = rank_seed(params.seed, 0, prompt_index)
        seed = None if seed is None else seed % 2**31  # int32-safe
        return import_vllm().SamplingParams(
            n=params.n, temperature=float(params.temperature), top_p=float(params.top_p),
            max_tokens=max_new_tokens or params.max_new_tokens, seed=seed, logprobs=0, detokenize=False,
            min_tokens=min(params.min_tokens, max_new_tokens or params.max_new_tokens),
            # explicit stop ids replace the eos (ignore_eos) so exactly these ids stop a sample
            stop_token_ids=None if stop is None else list(stop), ignore_eos=stop is not None)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None,
                 seeds: Sequence[int] | None = None) -> list[list[RolloutOutput]]:
        """One list of ``params.n`` outputs per prompt; ``max_new_tokens`` and ``seeds`` (one int in
        [0, 2**63) per prompt) as in ``HFRolloutEngine.generate``."""
        if params.top_p < 1.0:
            warn_once("vLLM log-probs with top_p < 1 are renormalised over the nucleus and differ from "
                      "the trainer's recomputation (full temperature-scaled distribution)")
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        budgets = check_budgets(max_new_tokens, len(prompts), params)
        prompt_seeds = check_seeds(seeds, len(prompts))
        sampling = [self.vllm_sampling_params(params, i, budgets[i], None if prompt_seeds is None else prompt_seeds[i])
                    for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        return convert_vllm_outputs(prompts, outputs, params.n)

    def load_weights(self, model_or_state_dict) -> None:
        """Push HF-named weights (a state dict, or a plain/merged HF module's) into every vLLM worker
        through ``LLM.apply_model`` (the model's ``load_weights``), then drop the prefix cache."""
        state = model_or_state_dict
        if isinstance(state, torch.nn.Module):
            state = unwrap_model(state)
            if hasattr(state, "peft_config"):
                raise ValueError("load_weights: merge the LoRA adapter first (posttrain.models.merge_lora)")
            state = state.state_dict()
        if not isinstance(state, Mapping):
            raise ValueError(f"load_weights expects a torch.nn.Module or a state dict, not {type(state).__name__}")
        self.update_weights(state.items())
        self.weights_updated()

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push some HF-named weights (one sync bucket) into vLLM's model (its ``load_weights`` maps
        the names onto vLLM's fused layout)."""
        weights = [(name, tensor.detach()) for name, tensor in named]
        self.llm.apply_model(lambda model: model.load_weights(weights=weights))

    def weights_updated(self, version: int | None = None) -> None:
        """After the last bucket of a sync: cached prefixes were computed with the old weights. `version`
        is not recorded per token here: generation never overlaps a sync on vLLM (partial rollout is
        refused with it), so the trainer attributes each batch the version it was generated with."""
        self.llm.reset_prefix_cache()

    def weights_hash(self) -> None:
        """vLLM keeps the weights in its own fused layout, so they cannot be hashed by HF name here; a
        caller that must verify a sync hashes what it sent (`posttrain.utils.weights_hash.WeightsDigest`)."""
        return None

    def sync_weights(self, model) -> None:
        self.load_weights(model)

    def sleep(self, level: int = 1) -> None:
        """Release GPU memory (the LLM must be built with ``enable_sleep_mode=True``)."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()
