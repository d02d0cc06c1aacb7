"""`SingleTurnSampler`: the RL trainer's rollouts without an agent file: prompt tokens → sampled
response tokens → one batched reward call. (Not OpenRLHF's `SingleTurnAgentExecutor`, the agent-file
class in `agents/agent_api.py`, which generates and scores each sample on its own.) The step's prompts
form one engine batch (`rollout/async_engine.generate_all`: the samples the async front that agents
use would give, decoded in the caller's thread).

Token-in, token-out: the rollout keeps the engine's token ids and sampling log-probs. A reward
function or server gets OpenRLHF's inputs: ``queries`` = the whole sampled sequence (prompt +
response token ids) decoded with ``skip_special_tokens=False`` (so a format check sees the EOS a
finished answer ends with), ``prompts`` = the prompt texts, ``labels``. A reward model that can
read token ids (``score_tokens``) scores the sampled ids themselves, never re-tokenised text."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.rewards.result import RewardResult
from posttrain.rollout.async_engine import generate_all
from posttrain.rollout.types import PromptImages, rank_seed
from posttrain.utils.log import warn_once

# the names a reward function's own arguments take (OpenRLHF's and TRL's), never a column's
RESERVED_KWARGS = ("queries", "prompts", "labels", "completions", "completion_ids", "sequence_ids",
                   "prompt_messages")


@dataclass
class Rollout:
    """One sample; a rollout batch is group-contiguous (the n samples of a prompt are adjacent).
    ``budget`` is the most tokens this sample could generate (its own max_new_tokens).
    Multi-turn samples (``agents.multi_turn``): ``output_ids`` holds actions and environment feedback
    as fed and sampled, ``action_mask`` (one 0/1 per output token; None: all sampled) marks the
    actions, ``turns`` / ``env_tokens`` / ``step_time`` (seconds in the environment) describe the
    episode (``tool_call_errors``: its malformed tool calls, None when it offered no tools), and ``error``
    says why a failed episode has no tokens. ``policy_versions``: the distinct
    weights versions its tokens were sampled by (several with partial rollout), sorted."""
    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    prompt_text: str
    response_text: str
    label: object = None
    group: int = 0
    budget: int = 0
    action_mask: list[int] | None = None
    turns: int = 0
    env_tokens: int = 0
    step_time: float = 0.0
    tool_call_errors: int | None = None
    error: str | None = None
    policy_versions: list[int] | None = None  # the weights versions that sampled it (None: not recorded)
    cursor: int = 0  # the prompt stream's position after this sample's prompt (set by `collect`)
    image_inputs: dict | None = None  # its prompt's image tensors (a vision-language model; numpy)
    columns: dict | None = None  # its prompt row's other columns (`Prompt.columns`, shared, not copied)
    prompt_messages: list | None = None  # its prompt's chat messages (`Prompt.messages`), shared
    # what the reward source scores, when not the whole sequence (a tool episode: prompt + final answer)
    reward_ids: list[int] | None = None


@dataclass
class ScoredRollouts:
    rollouts: list[Rollout]
    rewards: torch.Tensor  # [B] float32
    scores: torch.Tensor  # [B] (dynamic filtering and pass@k use these)
    extra_logs: dict
    skipped: torch.Tensor  # [B] bool: reward could not be computed and the user asked to skip


def sample_budgets(prompts, params, max_len: int | None) -> list[int] | None:
    """Per-prompt generation budgets: None (``params.max_new_tokens`` for all) when ``max_len`` is
    None, else ``max(1, max_len - len(prompt))`` each (OpenRLHF with --rollout.max_new_tokens unset)."""
    if max_len is None:
        return None
    return [max(1, max_len - len(p.token_ids)) for p in prompts]


class SingleTurnSampler:
    """Samples a batch of prompts on the rollout engine(s) and scores it with one reward call (module
    docstring; `reward_source` None: every reward 0, a distillation run's); `run` is what
    `trainers/rl/collect.collect` and `evaluate.eval_metrics` call."""

    def __init__(self, engine, reward_source, tokenizer) -> None:
        self.engine = engine
        self.reward_source = reward_source
        self.tokenizer = tokenizer

    def run(self, prompts, params, group_offset: int = 0, max_len: int | None = None,
            on_generated=None) -> ScoredRollouts:
        """`prompts`: objects with `.text`, `.token_ids`, `.label` (posttrain.data.Prompt). With
        `max_len`, each prompt may generate `max_len - len(its tokens)` tokens (`sample_budgets`).
        `group_offset`: the index of the first prompt within the step; with `params.seed` set, prompt g
        samples with seed `rank_seed(params.seed, 0, group_offset + g)` (its global index), so the
        samples do not depend on how the step's prompts are split into calls or engines.
        `on_generated()`: called once the samples are generated, before they are scored (async RL
        releases the engines to a weight sync while a slow reward scores)."""
        budgets = sample_budgets(prompts, params, max_len)
        kwargs = {}
        if params.seed is not None:  # engines that take no seeds (test fakes) still work unseeded
            kwargs["seeds"] = [rank_seed(params.seed, 0, group_offset + g) for g in range(len(prompts))]
        images = [getattr(p, "image_inputs", None) for p in prompts]
        if any(im is not None for im in images):  # tensors for the HF engine, the PIL images for vLLM
            kwargs["images"] = [None if im is None else PromptImages(im, getattr(p, "images", None))
                                for p, im in zip(prompts, images)]
        outputs = generate_all(self.engine, [p.token_ids for p in prompts], params, max_new_tokens=budgets,
                               **kwargs)
        if on_generated is not None:
            on_generated()
        rollouts = []
        for g, (prompt, outs) in enumerate(zip(prompts, outputs)):
            prompt_text = reward_prompt_text(self.tokenizer, prompt)  # once per prompt, not per sample
            for out in outs:
                text = self.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
                rollouts.append(Rollout(prompt_ids=list(prompt.token_ids),
                                        output_ids=list(out.output_token_ids),
                                        rollout_logprobs=list(out.logprobs), finish_reason=out.finish_reason,
                                        prompt_text=prompt_text, response_text=text, label=prompt.label,
                                        group=group_offset + g,
                                        budget=budgets[g] if budgets else params.max_new_tokens,
                                        policy_versions=None if out.policy_versions is None
                                        else sorted(set(out.policy_versions)), image_inputs=images[g],
                                        columns=getattr(prompt, "columns", None),
                                        prompt_messages=getattr(prompt, "messages", None)))
        if self.reward_source is None:  # no reward source: a teacher's per-token term alone
            result = RewardResult(torch.zeros(len(rollouts)))
        else:
            result = score_rollouts(self.reward_source, self.tokenizer, rollouts)
        return ScoredRollouts(rollouts=rollouts, rewards=result.rewards.float(), scores=result.scores.float(),
                              extra_logs=result.extra_logs, skipped=result.skipped)


def reward_prompt_text(tokenizer, prompt) -> str:
    """The prompt text a reward function gets: the rendered prompt; for a prompt with images, its token ids
    decoded (the image tokens expanded), so that each decoded query (prompt + response) starts with it, as a
    text prompt's does."""
    if getattr(prompt, "image_inputs", None) is None:
        return prompt.text
    return tokenizer.decode(prompt.token_ids, skip_special_tokens=False)


def score_rollouts(reward_source, tokenizer, rollouts: list[Rollout]):
    """One batched call of the reward source on whole sequences (prompt + everything after it, or a
    sample's `reward_ids`): token ids for a reward model, OpenRLHF's decoded queries for a function or
    server (module docstring). A source with `takes_columns` (a reward function, a CompositeReward) also
    gets the keyword arguments of `reward_kwargs` (a sample with `reward_ids`: its `completions` and
    `completion_ids` are what follows the prompt there, a tool episode's final answer), and one with
    `needs_token_ids` (a CompositeReward holding a reward model) the token ids as `sequence_ids`."""
    sequences = [r.reward_ids or r.prompt_ids + r.output_ids for r in rollouts]
    if hasattr(reward_source, "score_tokens"):
        return reward_source.score_tokens(sequences)
    queries = tokenizer.batch_decode(sequences, skip_special_tokens=False)
    kwargs = reward_kwargs(rollouts) if getattr(reward_source, "takes_columns", False) else {}
    for i, r in enumerate(rollouts):
        if r.reward_ids and kwargs:  # a tool episode: its completion is the final answer
            answer = list(r.reward_ids[len(r.prompt_ids):])
            kwargs["completion_ids"][i] = answer
            kwargs["completions"][i] = tokenizer.decode(answer, skip_special_tokens=True)
    if getattr(reward_source, "needs_token_ids", False):
        kwargs["sequence_ids"] = sequences
    return reward_source.score(queries, [r.prompt_text for r in rollouts], [r.label for r in rollouts],
                               **kwargs)


def reward_kwargs(rollouts: list[Rollout]) -> dict:
    """TRL's keyword arguments of a reward function: `completions` (the response texts), `completion_ids`
    (the response token ids) and one list of B values per column of the prompt rows (`Rollout.columns`;
    None where a row lacks it); `prompt_messages` (each prompt's chat messages or None, when any has them)
    is for `PythonRewardFunction.call` alone. A column named like an argument (RESERVED_KWARGS) is left
    out, with a warning."""
    kwargs = {"completions": [r.response_text for r in rollouts],
              "completion_ids": [list(r.output_ids) for r in rollouts]}
    if any(r.prompt_messages is not None for r in rollouts):
        kwargs["prompt_messages"] = [r.prompt_messages for r in rollouts]
    for name in dict.fromkeys(k for r in rollouts for k in (r.columns or {})):
        if name in RESERVED_KWARGS:
            warn_once(f"the prompt data's column {name!r} is not passed to the reward function: {name} is "
                      "one of its own arguments; rename the column")
            continue
        kwargs[name] = [(r.columns or {}).get(name) for r in rollouts]
    return kwargs
