"""A process reward model (`--reward.prm`) as a reward source: it scores each step of a policy's response,
and each score becomes a token reward on the response token that ends the step
(`trainers.rl.experience_maker`).

Per sample, from the token ids as sampled (prompt ids, response ids) and the policy's tokenizer:

1. the response text is the response ids decoded without special tokens (as `Rollout.response_text`); it is
   split on the separator into steps, and an empty piece (a trailing separator, two in a row) is no step;
2. a step's end is the response token that holds the step's last character (`step_end_tokens`: the shortest
   decoded prefix of the response ids that covers the character); a separator after it is no part of it;
3. the PRM reads ``prompt + render_steps("", steps, placeholder, separator)``: the prompt decoded from its ids
   with special tokens (the text the policy saw, chat markup included, as a reward model's queries), then
   each step followed by a space and the placeholder, tokenised by the PRM's own tokenizer (no automatic
   special tokens). Longer than the PRM's limit (`max_len`, else its config's `max_position_embeddings`):
   its last `max_len` tokens are kept, so the prompt loses its beginning first and a step whose placeholder
   falls off (the first steps) gets no score (counted as dropped);
4. the placeholders read are the ones this rendering put there (by character offset; the placeholder's text
   inside a step is no step end); one that the PRM's tokenizer merged with the text around it (checked
   at start-up for plain steps: `PRMSpec.token_ids`) leaves its step unscored, counted as dropped; each
   step's score is `step_scores(placeholder_logits(...))`: the probability of the first (good) token.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from posttrain.algorithms.process_reward import placeholder_logits, rendered_steps, step_scores
from posttrain.rewards.result import RewardError
from posttrain.rewards.reward_model import RewardModelSource, right_padded


@dataclass
class StepRewards:
    """Per sample: ``ends`` the response-token index of each scored step's end, ``scores`` its score (same
    length), ``steps`` how many steps its response has, ``dropped`` how many of them (the first) got no
    score because the PRM's input was too long."""

    ends: list[list[int]] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)

    @staticmethod
    def concat(parts: list[StepRewards]) -> StepRewards:
        return StepRewards(*([x for p in parts for x in getattr(p, name)]
                             for name in ("ends", "scores", "steps", "dropped")))


def split_steps(text: str, separator: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` character spans of the pieces of ``text`` split on ``separator``, each without
    its trailing whitespace; a piece of whitespace only is no step.
    ("a\\nbc \\n \\n" → [(0, 1), (2, 4)]; "" → [].)"""
    if not separator:
        raise ValueError("the step separator must be non-empty")
    spans, start = [], 0
    for piece in text.split(separator):
        if piece.strip():
            spans.append((start, start + len(piece.rstrip())))
        start += len(piece) + len(separator)
    return spans


def step_end_tokens(token_ids: list[int], ends: list[int], decode) -> list[int]:
    """For each character end ``e`` (exclusive) of ``decode(token_ids)``, the index of the token that holds
    character ``e - 1``: the smallest ``k`` with ``len(decode(token_ids[:k])) >= e``, minus one (a binary
    search over decoded prefixes; each prefix decoded once), moved on while that prefix ends inside a
    character (a byte-level tokenizer decodes a partial character as U+FFFD, which may count as more
    characters than the whole one). ``decode``: token-id list → text."""
    texts: dict[int, str] = {}

    def prefix(k: int) -> str:
        if k not in texts:
            texts[k] = decode(token_ids[:k])
        return texts[k]

    def covered(k: int) -> int:
        return len(prefix(k))

    out = []
    for e in ends:
        lo, hi = 1, len(token_ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if covered(mid) >= e:
                hi = mid
            else:
                lo = mid + 1
        while lo < len(token_ids) and (prefix(lo).endswith("\ufffd") or covered(lo) < e):
            lo += 1
        out.append(lo - 1)
    return out


class ProcessRewardSource(RewardModelSource):
    """A PRM (a causal LM, frozen) placed and loaded as a reward model is (`RewardModelSource`: the reward
    role, ZeRO-3 shards over a Ray group's ranks, offload); `score_steps` is its one call (module doc).
    `spec` (`models.prm_spec.PRMSpec`): placeholder, reward tokens, separator; `policy_tokenizer` decodes the
    sampled ids; the PRM's own tokenizer (its folder's) reads the text."""

    model_role = "ref"  # `ModelSetup.build`: a causal LM, frozen

    def __init__(self, path, spec, policy_tokenizer, **kwargs):
        super().__init__(path, **kwargs)
        self.spec = spec
        self.policy_tokenizer = policy_tokenizer
        self.placeholder_id, self.reward_ids = spec.token_ids(self.tokenizer)
        if not getattr(self.tokenizer, "is_fast", False):
            raise RewardError(f"PRM {self.path}: its tokenizer has no character offsets (a slow tokenizer); "
                              "the placeholders are found by offset: give the model a tokenizer.json")
        if self.max_len is None:
            self.max_len = getattr(self.model.config, "max_position_embeddings", None)

    def check_vocabulary(self, tokenizer) -> None:
        """Nothing to check: the PRM reads text with its own tokenizer (its tokens: `spec.token_ids`)."""

    def _no_sequence_score(self, *args, **kwargs):
        raise TypeError(f"{self!r} scores steps (`score_steps`), not sequences: it has no score head")

    values = score = score_tokens = _no_sequence_score

    def prm_input(self, prompt_ids: list[int], response_ids: list[int]):
        """(PRM token ids, the index of each kept step's placeholder in them, each kept step's end in the
        response, steps, dropped) of one sample (module doc)."""
        decode = self.policy_tokenizer.decode
        text = decode(response_ids, skip_special_tokens=True)
        spans = split_steps(text, self.spec.step_separator)
        if not spans:
            return [], [], [], 0, 0
        ends = step_end_tokens(list(response_ids), [e for _, e in spans],
                               lambda ids: decode(ids, skip_special_tokens=True))
        prompt = decode(prompt_ids, skip_special_tokens=False)
        steps = [text[s:e] for s, e in spans]
        sep, mark = self.spec.step_separator, self.spec.placeholder_token
        text, marks = rendered_steps(prompt, steps, mark, sep)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, token_ends = enc["input_ids"], [e for _, e in enc["offset_mapping"]]
        positions = {}  # step -> its placeholder's token; a placeholder merged with its context: no score
        for i, at in enumerate(marks):
            j = bisect.bisect_left(token_ends, at + len(mark))  # the token holding its last character
            if j < len(ids) and ids[j] == self.placeholder_id:
                positions[i] = j
        cut = max(len(ids) - self.max_len, 0) if self.max_len else 0
        kept = [i for i, p in positions.items() if p >= cut]
        dropped = len(steps) - len(kept)
        return ids[cut:], [positions[i] - cut for i in kept], [ends[i] for i in kept], len(steps), dropped

    def score_steps(self, prompts: list[list[int]], responses: list[list[int]]) -> StepRewards:
        """The step rewards (`StepRewards`) of the samples ``prompts[i] + responses[i]`` (token ids as
        sampled). Only samples with a scored step are forwarded; a sharded model still runs its share of
        the other ranks' forwards."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts for {len(responses)} responses")
        out = StepRewards()
        rows = []  # (sample, PRM ids, placeholder positions)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids, positions, ends, steps, dropped = self.prm_input(p, r)
            out.ends.append(ends)
            out.scores.append([])
            out.steps.append(steps)
            out.dropped.append(dropped)
            if positions:
                rows.append((i, ids, positions))
        scores = self.forward_batches(
            len(rows), lambda part: self._step_scores(None if part is None else rows[part]))
        for (i, _, positions), s in zip(rows, (x for batch in scores for x in batch)):
            if len(s) != len(positions):
                raise RewardError(f"PRM {self.path}: {len(s)} placeholders scored for {len(positions)} steps")
            out.scores[i] = s
        return out

    def _step_scores(self, rows) -> list[list[float]]:
        """Each row's step scores; None: a stand-in forward of one token (collective forwards)."""
        from posttrain.models import forward_logits

        if rows is None:
            one = torch.ones((1, 1), dtype=torch.long, device=self.device)
            forward_logits(self.model, {"input_ids": one * 0, "attention_mask": one})
            return []
        ids, mask = right_padded([r[1] for r in rows], 0)
        keep = sorted({p for r in rows for p in r[2]})  # only the placeholders' columns get logits
        column = {p: c for c, p in enumerate(keep)}
        marked = torch.full((len(rows), len(keep)), -1, dtype=torch.long)
        for b, (_, _, positions) in enumerate(rows):
            marked[b, [column[p] for p in positions]] = self.placeholder_id
        batch = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        logits = forward_logits(self.model, batch, keep=torch.tensor(keep, device=self.device)).cpu()
        step_logits = placeholder_logits(logits, marked, self.placeholder_id, self.reward_ids)
        scores = step_scores(step_logits).tolist()
        counts = [len(r[2]) for r in rows]
        starts = [sum(counts[:b]) for b in range(len(rows))]
        return [scores[s:s + c] for s, c in zip(starts, counts)]

    def __repr__(self) -> str:
        return f"ProcessRewardSource({self.path!r}, {self.spec})"
