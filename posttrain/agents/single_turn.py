"""Single-turn executor: prompt tokens → sampled response tokens → one batched reward call.

Token-in, token-out: the rollout keeps the engine's token ids and sampling log-probs; the decoded
text is only for the reward function (`queries` = prompt text + response text, `prompts`, `labels`)
and for logs."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    """One sample; a rollout batch is group-contiguous (the n samples of a prompt are adjacent)."""
    prompt_ids: list[int]
    output_ids: list[int]
    rollout_logprobs: list[float]
    finish_reason: str
    prompt_text: str
    response_text: str
    label: object = None
    group: int = 0


@dataclass
class ScoredRollouts:
    rollouts: list[Rollout]
    rewards: torch.Tensor  # [B] float32
    scores: torch.Tensor  # [B] (dynamic filtering and pass@k use these)
    extra_logs: dict
    skipped: torch.Tensor  # [B] bool: reward could not be computed and the user asked to skip


class SingleTurnExecutor:
    def __init__(self, engine, reward_source, tokenizer) -> None:
        self.engine = engine
        self.reward_source = reward_source
        self.tokenizer = tokenizer

    def run(self, prompts, params, group_offset: int = 0) -> ScoredRollouts:
        """`prompts`: objects with `.text`, `.token_ids`, `.label` (posttrain.data.Prompt)."""
        outputs = self.engine.generate([p.token_ids for p in prompts], params)
        rollouts = []
        for g, (prompt, outs) in enumerate(zip(prompts, outputs)):
            for out in outs:
                text = self.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
                rollouts.append(Rollout(prompt_ids=list(prompt.token_ids), output_ids=list(out.output_token_ids),
                                        rollout_logprobs=list(out.logprobs), finish_reason=out.finish_reason,
                                        prompt_text=prompt.text, response_text=text, label=prompt.label,
                                        group=group_offset + g))
        result = self.reward_source.score([r.prompt_text + r.response_text for r in rollouts],
                                          [r.prompt_text for r in rollouts], [r.label for r in rollouts])
        return ScoredRollouts(rollouts=rollouts, rewards=result.rewards.float(), scores=result.scores.float(),
                              extra_logs=result.extra_logs, skipped=result.skipped)
