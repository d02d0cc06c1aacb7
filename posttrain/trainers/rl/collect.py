"""One rollout batch: draw prompts, sample n responses each, score them, shape the rewards, and
(DAPO dynamic filtering) keep only groups whose mean score lies strictly inside (low, high),
refilling with fresh prompts until the batch is full or the extra-draw budget is spent."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from posttrain.algorithms.shaping import (
    dynamic_filter,
    missing_eos_penalty,
    overlong_penalty,
    stop_properly_penalty,
)
from posttrain.rewards import RewardError
from posttrain.rollout import rank_seed
from posttrain.rollout.single_turn import ScoredRollouts


class PromptStream:
    """Prompts in a fresh seeded shuffle per episode; `cursor` counts prompts drawn so far (saved in
    checkpoints so a resumed run continues with the same prompts)."""

    def __init__(self, num_prompts: int, seed: int, cursor: int = 0) -> None:
        self.n = num_prompts
        self.seed = seed
        self.cursor = cursor

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            episode, pos = divmod(self.cursor, self.n)
            out.append(int(np.random.default_rng([self.seed, episode]).permutation(self.n)[pos]))
            self.cursor += 1
        return out


@dataclass
class ShapingSettings:
    overlong_buffer_len: float | None
    overlong_penalty_factor: float
    stop_properly_penalty_coef: float | None
    missing_eos_penalty: float | None = None
    eos_ids: tuple[int, ...] = field(default_factory=tuple)  # the engine's default stop ids


def has_eos(rollout, eos_ids) -> bool:
    """Whether a token the policy generated (an action token: environment feedback does not count) is
    one of `eos_ids`."""
    mask = rollout.action_mask or [1] * len(rollout.output_ids)
    return any(m and tok in eos_ids for tok, m in zip(rollout.output_ids, mask))


def shape_rewards(batch: ScoredRollouts, s: ShapingSettings) -> int:
    """Shaping of `batch.rewards` in place (before the advantage baseline), in this order: the missing-EOS
    penalty (TRL, on the raw rewards), the overlong penalty, the stop-properly penalty; returns how many
    samples it changed. The overlong penalty reads each sample's own budget (`Rollout.budget`)."""
    lengths = torch.tensor([len(r.output_ids) for r in batch.rollouts], dtype=torch.float32)
    budgets = torch.tensor([r.budget for r in batch.rollouts], dtype=torch.float32)
    truncated = torch.tensor([r.finish_reason == "length" for r in batch.rollouts])
    before = batch.rewards.clone()
    if s.missing_eos_penalty is not None:
        eos = set(s.eos_ids)
        found = torch.tensor([has_eos(r, eos) for r in batch.rollouts], dtype=torch.bool)
        batch.rewards = missing_eos_penalty(batch.rewards, found, s.missing_eos_penalty)
    if s.overlong_buffer_len:
        batch.rewards = overlong_penalty(batch.rewards, lengths, budgets, s.overlong_buffer_len,
                                         s.overlong_penalty_factor)
    if s.stop_properly_penalty_coef is not None:
        batch.rewards = stop_properly_penalty(batch.rewards, truncated, s.stop_properly_penalty_coef)
    return int((batch.rewards != before).sum())


def concat(parts: list[ScoredRollouts]) -> ScoredRollouts:
    logs: dict = {}
    for p in parts:
        for k, v in p.extra_logs.items():
            logs.setdefault(k, []).append(torch.as_tensor(v, dtype=torch.float32).reshape(-1))
    return ScoredRollouts(rollouts=[r for p in parts for r in p.rollouts],
                          rewards=torch.cat([p.rewards for p in parts]),
                          scores=torch.cat([p.scores for p in parts]),
                          extra_logs={k: torch.cat(v) for k, v in logs.items()},
                          skipped=torch.cat([p.skipped for p in parts]))


def keep_groups(batch: ScoredRollouts, keep: torch.Tensor, n: int) -> ScoredRollouts:
    rows = torch.nonzero(keep.repeat_interleave(n)).flatten().tolist()
    return ScoredRollouts(rollouts=[batch.rollouts[i] for i in rows], rewards=batch.rewards[rows],
                          scores=batch.scores[rows],
                          extra_logs={k: v[rows] if isinstance(v, torch.Tensor)
                                      and v.numel() == len(keep) * n else v
                                      for k, v in batch.extra_logs.items()},
                          skipped=batch.skipped[rows])


def collect(executor, prompts, stream: PromptStream, params, *, batch_size: int, shaping: ShapingSettings,
            filter_range: tuple[float, float] | None, max_extra_draws: int,
            max_len: int | None = None, on_generated=None) -> tuple[ScoredRollouts, dict]:
    """`batch_size` prompt groups (fewer when filtering ran out of draws; logged). Each draw samples
    with its own seed (`params.seed` for the first, derived from it for refills), so refilled
    prompts never replay the first draw's random numbers. `max_len`: per-sample budgets
    (`SingleTurnSampler.run`); `on_generated`: passed to `SingleTurnSampler.run` (only
    without filtering, where the first draw is the only one)."""
    n = params.n
    kept: list[ScoredRollouts] = []
    kept_groups = drawn = draws = penalised = sampled = 0
    budget = batch_size + (max_extra_draws if filter_range else 0)
    metrics: dict[str, float] = {}
    while kept_groups < batch_size and drawn < budget:
        take = min(batch_size - kept_groups, budget - drawn)
        draw_params = params if draws == 0 or params.seed is None else replace(
            params, seed=rank_seed(params.seed, draws, 0))
        hook = {"on_generated": on_generated} if on_generated is not None else {}
        start = stream.cursor
        batch = executor.run([prompts[i] for i in stream.take(take)], draw_params, group_offset=kept_groups,
                             max_len=max_len, **hook)
        for r in batch.rollouts:
            r.cursor = start + (r.group - kept_groups) + 1
        drawn += take
        draws += 1
        penalised += shape_rewards(batch, shaping)
        sampled += len(batch.rollouts)
        if filter_range:
            keep = dynamic_filter(batch.scores.view(-1, n), *filter_range, valid=~batch.skipped.view(-1, n))
            batch = keep_groups(batch, keep, n)
        kept.append(batch)
        kept_groups += len(batch.rollouts) // n
    if kept_groups == 0:
        raise RewardError(
            f"dynamic filtering kept no prompt group out of {drawn} drawn (every group's mean score was at "
            f"or outside --algo.dynamic_filtering_range {filter_range}); widen the range or check the reward")
    metrics["shaping/penalised_frac"] = penalised / max(sampled, 1)  # over every draw
    if filter_range:
        metrics["filter/pass_rate"] = kept_groups / drawn
        metrics["filter/kept_groups"] = kept_groups
        metrics["filter/drawn_prompts"] = drawn
    out = concat(kept)
    for i, r in enumerate(out.rollouts):  # renumber groups contiguously after filtering
        r.group = i // n
    return out, metrics


class GroupBuffer:
    """Oversampling (`--rollout.vllm_generate_batch_size` G != `--rollout.batch_size` B; OpenRLHF's
    `_sample_buffer`): `take(draw)` calls `draw()` (one `collect` of G prompt groups, filtering
    included) only while fewer than B groups are buffered, and returns the B oldest groups, renumbered.
    Groups keep their prompt-stream positions (`Rollout.cursor`): a batch's cursor is its last group's,
    so a checkpoint taken after it neither replays nor skips a prompt (buffered groups are drawn again
    on resume)."""

    def __init__(self, batch_size: int, n: int) -> None:
        self.batch_size, self.n = batch_size, n
        self.buffer: ScoredRollouts | None = None

    def __len__(self) -> int:
        return 0 if self.buffer is None else len(self.buffer.rollouts) // self.n

    def take(self, draw) -> tuple[ScoredRollouts, dict, int]:
        metrics: dict = {}
        calls = 0
        while len(self) < self.batch_size:
            scored, drawn = draw()
            metrics.update(drawn)
            calls += 1
            self.buffer = scored if self.buffer is None else concat([self.buffer, scored])
        first = torch.arange(len(self)) < self.batch_size
        batch = keep_groups(self.buffer, first, self.n)
        self.buffer = keep_groups(self.buffer, ~first, self.n) if len(self) > self.batch_size else None
        for part in (batch, self.buffer):
            for i, r in enumerate(part.rollouts if part is not None else []):
                r.group = i // self.n
        metrics["rollout/generation_calls"] = calls
        metrics["rollout/buffered_groups"] = len(self)
        return batch, metrics, max(r.cursor for r in batch.rollouts)
