"""OpenRLHF's agent API (`openrlhf.utils.agent`), implemented by posttrain: an agent file written for
OpenRLHF 0.10.2 runs unchanged (`--train.agent_func_path`; its `openrlhf.utils.agent` import resolves
here when OpenRLHF is not installed, see `openrlhf_modules`).

A file defines `class AgentInstance(AgentInstanceBase)` (one environment per episode: `async
reset(states)` → `{"observation": text}`, `async step(states)` → `{"rewards", "scores",
"environment_feedback", "done", "sampling_params", "extra_logs"}`) and `class AgentExecutor(
MultiTurnAgentExecutor)` (or any `AgentExecutorBase` with `async execute(...)`).

`MultiTurnAgentExecutor.execute` follows OpenRLHF's loop: tokenise the observation (no special
tokens), then per turn generate with a budget of `max_length - len(context)` (capped by the
`max_tokens` the executor was given: posttrain passes `--rollout.max_new_tokens` as a per-turn cap,
OpenRLHF overwrites it), record the action's
token range, call `step` with the texts (posttrain adds `action_token_ids` and `finish_reason` to its
states), append the action tokens as sampled and the feedback's
tokens, and stop at `done` or when the budget is spent. Rewards add up over turns (`rewards` as a
tensor or number; None from every step: the run's reward source scores the episode); `scores` and
`extra_logs` are the last step's. posttrain's deliberate differences
(docs/from-openrlhf.md, "Multi-turn agents"): the feedback of the last turn is cut so the sequence never
exceeds `max_length` (OpenRLHF cuts the finished sequence at training time), `truncated` is set when the
budget ended the episode, and a too-long initial observation is an error instead of being cut from the
left. A vision-language model's processor as `hf_tokenizer` (as OpenRLHF passes it) and the prompt's
`images`, the row's image references as OpenRLHF passes them (`Prompt.image_refs`: relative paths made
absolute), decoded here as the data's images are (`data.images.load_images`, transparency over white, within
the run's --data.max_image_bytes / --data.max_image_pixels / --data.image_url_timeout, which posttrain's
`llm_engine` carries as `image_limits`; so are `environment_images`): the observation's image placeholders
are expanded into image tokens, every turn is generated
with the images so far, and `step()` may return `environment_images` (one per placeholder in its
feedback), appended with their tokens when the whole feedback fits the budget, else left out with their
tokens (the feedback's rest cut to fit, as for text); `mm_train_inputs` holds the episode's image
tensors. The result dict has OpenRLHF's keys (`observation_tokens`, `action_ranges`, `rollout_log_probs`,
`reward`, `scores`, `extra_logs`, ...) plus `truncated`, `turns`, `env_tokens` and `step_time`.

`llm_engine` is an `EpisodeEngine` (`posttrain.agents.episode`): `await llm_engine.generate(token_ids,
sampling_params)` returns a vLLM-shaped request output (`.outputs[0].token_ids`, `.text`, `.logprobs`
as `[{token_id: Logprob}]`, `.finish_reason`), whatever engine serves it.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from copy import deepcopy

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor", "SingleTurnAgentExecutor"]


class AgentInstanceBase(ABC):
    """One environment per episode (OpenRLHF's contract, module docstring)."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """Runs one episode: `await execute(prompt, label, sampling_params, max_length, hf_tokenizer,
    llm_engine, images=None)` → the result dict (module docstring)."""

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")


def encode_text(tokenizer, text: str) -> list[int]:
    """Text as the model is fed it between turns: tokenised without special tokens added (OpenRLHF).
    `tokenizer` may be a vision-language model's processor (its tokenizer encodes)."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class EpisodeImages:
    """The images of one episode (a vision-language model): the processor (`hf_tokenizer` is one, as in
    OpenRLHF), every image so far (PIL, in the order their tokens appear) and their tensors. `encode` turns a
    text with image placeholders and its images (references or PIL images, decoded as the data's are, within
    `limits`) into token ids (the placeholders expanded), image tensors and the decoded images, which `keep`
    keeps."""

    def __init__(self, processor, limits=None) -> None:
        self.processor, self.limits = processor, limits
        self.pil: list = []
        self.tensors: list[dict] = []

    @staticmethod
    def of(hf_tokenizer, llm_engine=None) -> EpisodeImages | None:
        """The episode's images when `hf_tokenizer` is a processor, read within the run's image limits that
        posttrain's episode engine carries (`llm_engine.image_limits`: --data.max_image_bytes,
        --data.max_image_pixels, --data.image_url_timeout; without them the defaults)."""
        if getattr(hf_tokenizer, "image_processor", None) is None:
            return None
        return EpisodeImages(hf_tokenizer, getattr(llm_engine, "image_limits", None))

    def encode(self, text: str, images, location: str) -> tuple[list[int], dict, list]:
        """(ids, tensors, images) of `text`: `images` (one reference or a list, as `load_images` reads them,
        within `limits`; a bad one is a DataError naming `location`) decoded to RGB (transparency over white)
        and encoded."""
        from posttrain.data.images import ImageLimits, load_images
        from posttrain.data.vision_samples import encode_with_images

        pil = load_images(images, location, limits=self.limits or ImageLimits())
        return (*encode_with_images(self.processor, text, pil, location), pil)

    def keep(self, pil: list, tensors: dict) -> None:
        self.pil += list(pil)
        self.tensors.append(tensors)

    def merged(self) -> dict | None:
        from posttrain.data.vision_samples import concat_image_inputs

        return concat_image_inputs(self.tensors)

    def request(self) -> dict:
        """`llm_engine.generate` keywords for the context so far: none without images."""
        if not self.tensors:
            return {}
        return {"multi_modal_data": {"image": list(self.pil)}, "image_inputs": self.merged()}

    def text_ids(self, text: str) -> list[int]:
        """`text` tokenised without its image tokens (feedback whose images did not fit the budget)."""
        placeholders = {getattr(self.processor, "image_token", None),
                        getattr(self.processor, "video_token", None)}
        drop = {self.processor.tokenizer.convert_tokens_to_ids(t) for t in placeholders if t}
        return [t for t in encode_text(self.processor, text) if t not in drop]


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's `MultiTurnAgentExecutor(agent_instance_cls)` (module docstring)."""

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"MultiTurnAgentExecutor needs a subclass of AgentInstanceBase, got "
                            f"{agent_instance_cls!r}")
        self.agent_instance_cls = agent_instance_cls

    def new_instance(self, hf_tokenizer) -> AgentInstanceBase:
        """The environment of one episode (OpenRLHF: `agent_instance_cls()`; posttrain's tool environments
        override it to give theirs the tokenizer)."""
        return self.agent_instance_cls()

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        # imported here: an agent file's `from openrlhf.utils.agent import ...` stays light
        from posttrain.rewards.result import reward_scalar

        seen = EpisodeImages.of(hf_tokenizer, llm_engine)
        if images and seen is None:
            raise ValueError("images: the prompt has images but the model is not a vision-language model")
        agent = self.new_instance(hf_tokenizer)
        reset = await agent.reset({"observation": prompt, "label": label})
        if not isinstance(reset, dict) or not isinstance(reset.get("observation"), str):
            raise ValueError(f"reset() must return a dict with an 'observation' string, got {reset!r:.200}")
        observation_text = reset["observation"]
        if images:
            context, tensors, pil = seen.encode(observation_text, images, "execute(images=)")
            seen.keep(pil, tensors)
        else:
            context = encode_text(hf_tokenizer, observation_text)
        if len(context) >= max_length:
            raise ValueError(f"the initial observation has {len(context)} tokens, no room to generate within "
                             f"--data.max_len {max_length}")
        prompt_len = len(context)
        logprobs = [0.0] * prompt_len
        action_ranges: list[tuple[int, int]] = []
        total_reward, scores, extra_logs = None, None, {}
        truncated, env_tokens, step_time, turns = False, 0, 0.0, 0
        # posttrain: --rollout.max_new_tokens per turn
        turn_cap = getattr(sampling_params, "max_tokens", None)
        while True:
            budget = max_length - len(context)
            if budget <= 0:
                truncated = True
                break
            sampling_params.max_tokens = min(budget, turn_cap) if turn_cap else budget
            out = (await llm_engine.generate(list(context), deepcopy(sampling_params),
                                             **(seen.request() if seen else {}))).outputs[0]
            action = list(out.token_ids)
            action_ranges.append((len(context), len(context) + len(action)))
            context += action
            logprobs += [entry[token].logprob for entry, token in zip(out.logprobs, action)]
            turns += 1
            t0 = time.perf_counter()
            result = await agent.step({"observation_text": observation_text, "action_text": out.text,
                                       "label": label, "sampling_params": sampling_params,
                                       "action_token_ids": action, "finish_reason": out.finish_reason})
            step_time += time.perf_counter() - t0
            result = _check_step(result)
            if result["rewards"] is not None:  # None: the run's reward source scores the episode (posttrain)
                total_reward = (total_reward or 0.0) + reward_scalar(result["rewards"], "step()['rewards']")
            scores = result.get("scores", total_reward)
            extra_logs = result.get("extra_logs") or {}
            feedback_text = result["environment_feedback"]
            feedback = self._feedback_ids(feedback_text, result.get("environment_images"), seen,
                                          max_length - len(context), hf_tokenizer)
            # what does not fit is cut: the episode ends below
            feedback = feedback[:max_length - len(context)]
            observation_text = observation_text + out.text + feedback_text
            context += feedback
            logprobs += [0.0] * len(feedback)
            env_tokens += len(feedback)
            if result.get("sampling_params"):
                sampling_params = result["sampling_params"]
            if result["done"]:
                break
            if len(context) >= max_length:  # the budget, not the environment, ends it
                truncated = True
                break
        truncated = truncated or out.finish_reason == "length"  # the last action ran out of budget
        return {"prompt": prompt, "label": label, "images": images,
                "mm_train_inputs": seen.merged() if seen else None, "reward": total_reward,
                "scores": reward_scalar(scores, "step()['scores']") if scores is not None else None,
                "observation_tokens": context, "action_ranges": action_ranges, "rollout_log_probs": logprobs,
                "extra_logs": extra_logs, "truncated": truncated, "prompt_length": prompt_len, "turns": turns,
                "env_tokens": env_tokens, "step_time": step_time}


    @staticmethod
    def _feedback_ids(text: str, images, seen: EpisodeImages | None, room: int, hf_tokenizer) -> list[int]:
        """The feedback's token ids. With `environment_images` (a vision-language model) its placeholders are
        expanded and the images join the episode's, when the whole feedback fits the `room` left; when it does
        not, the images are left out and their tokens dropped from the feedback (whose rest is cut to fit)."""
        if not images:
            return encode_text(hf_tokenizer, text)
        if seen is None:
            raise ValueError("step() returned environment_images but the model is not a vision-language "
                             "model")
        ids, tensors, pil = seen.encode(text, images, "step()['environment_images']")
        if len(ids) <= room:
            seen.keep(pil, tensors)
            return ids
        return seen.text_ids(text)


_STEP_KEYS = ("rewards", "environment_feedback", "done")


def _check_step(result) -> dict:
    """The keys OpenRLHF's loop reads without a default must be there, with usable types."""
    if not isinstance(result, dict):
        raise ValueError(f"step() must return a dict, got {type(result).__name__}")
    missing = [k for k in _STEP_KEYS if k not in result]
    if missing:
        raise ValueError(f"step() result lacks {', '.join(repr(k) for k in missing)} "
                         f"(it has {', '.join(repr(k) for k in result) or 'no keys'})")
    if not isinstance(result["environment_feedback"], str):
        raise ValueError(f"step()['environment_feedback'] must be a string, got "
                         f"{type(result['environment_feedback']).__name__}")
    return result


class SingleTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's `SingleTurnAgentExecutor(remote_rm_url=None)`: one generation; with a reward file or
    URL, scored through posttrain's reward sources (`posttrain.rewards`). posttrain's own single-turn
    rollout (`--reward.*` without an agent file) is `posttrain.rollout.single_turn.SingleTurnSampler`,
    batched."""

    def __init__(self, remote_rm_url=None):
        self.remote_rm_url = remote_rm_url
        self._source = None

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        seen = EpisodeImages.of(hf_tokenizer, llm_engine)
        if images and seen is None:
            raise ValueError("images: the prompt has images but the model is not a vision-language model")
        if images:
            ids, tensors, pil = seen.encode(prompt, images, "execute(images=)")
            seen.keep(pil, tensors)
        else:
            ids = encode_text(hf_tokenizer, prompt)
        if len(ids) >= max_length:
            raise ValueError(f"the prompt has {len(ids)} tokens, no room to generate within --data.max_len "
                             f"{max_length}")
        params = deepcopy(sampling_params)
        if getattr(params, "max_tokens", None) is None:
            params.max_tokens = max_length - len(ids)
        params.max_tokens = min(params.max_tokens, max_length - len(ids))
        out = (await llm_engine.generate(list(ids), params, **(seen.request() if seen else {}))).outputs[0]
        action = list(out.token_ids)
        result = {"prompt": prompt, "label": label, "images": images,
                  "mm_train_inputs": seen.merged() if seen else None, "observation_tokens": ids + action,
                  "action_ranges": [(len(ids), len(ids) + len(action))],
                  "rollout_log_probs": [0.0] * len(ids) + [e[t].logprob
                                                           for e, t in zip(out.logprobs, action)],
                  "truncated": out.finish_reason == "length", "reward": None, "scores": None,
                  "extra_logs": {}, "prompt_length": len(ids), "turns": 1, "env_tokens": 0, "step_time": 0.0}
        if self.remote_rm_url:
            import asyncio

            from posttrain.rewards import make_reward_source

            if self._source is None:
                self._source = make_reward_source(self.remote_rm_url, None)
            query = hf_tokenizer.decode(ids + action, skip_special_tokens=False)
            scored = await asyncio.to_thread(self._source.score, [query], [prompt], [label])
            result.update(reward=float(scored.rewards[0]), scores=float(scored.scores[0]),
                          extra_logs={k: v for k, v in scored.extra_logs.items()})
        return result
