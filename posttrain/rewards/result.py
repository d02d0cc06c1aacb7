"""What every reward source returns, and the checks that turn a raw reward output (a reward_func's
return value or a reward server's JSON) into it.

A raw output is either a dict `{"rewards": ..., "scores": ... (optional), "extra_logs": {name: value}
(optional), "skipped": ... (optional)}` or a bare sequence of B rewards. Rewards and scores are a
list / tuple / numpy array / 1-D torch tensor of B finite numbers. An extra_logs value is one number
(a batch statistic, e.g. accuracy) or B numbers (one per sample).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from posttrain.utils.errors import UserError

ON_ERROR = ("raise", "skip")
_MAX_LISTED = 5


class RewardError(UserError, RuntimeError):
    """A reward could not be computed; the message names the source (file / URL / model) and the cause."""


@dataclass
class RewardResult:
    """Rewards for one batch of B samples.

    rewards: float32 [B], what advantages are computed from (0 for skipped samples).
    scores: float32 [B], what dynamic filtering reads; defaults to a copy of rewards.
    extra_logs: name -> float32 [B] (per sample) or float (batch statistic), for the metrics log.
    skipped: bool [B], True where the reward could not be computed and the sample was skipped on
    request (`on_error="skip"`); the trainer must drop or mask these samples and count them.
    skip_reasons: one line per problem that caused skipping (for the log).
    """

    rewards: torch.Tensor
    scores: torch.Tensor | None = None
    extra_logs: dict = field(default_factory=dict)
    skipped: torch.Tensor | None = None
    skip_reasons: list = field(default_factory=list)

    def __post_init__(self):
        self.rewards = torch.as_tensor(self.rewards, dtype=torch.float32).reshape(-1)
        n = self.rewards.numel()
        self.scores = (self.rewards.clone() if self.scores is None
                       else torch.as_tensor(self.scores, dtype=torch.float32).reshape(-1))
        self.skipped = (torch.zeros(n, dtype=torch.bool) if self.skipped is None
                        else torch.as_tensor(self.skipped, dtype=torch.bool).reshape(-1))
        for name, t in (("scores", self.scores), ("skipped", self.skipped)):
            if t.numel() != n:
                raise ValueError(f"RewardResult: {name} has {t.numel()} values for {n} rewards")

    def __len__(self) -> int:
        return self.rewards.numel()

    @property
    def num_skipped(self) -> int:
        return int(self.skipped.sum())

    def to_json(self) -> dict:
        """Plain JSON types: rewards, scores, skipped (lists), extra_logs (name -> list
        or float), skip_reasons."""
        logs = {k: (v.tolist() if isinstance(v, torch.Tensor) else float(v))
                for k, v in self.extra_logs.items()}
        return {"rewards": self.rewards.tolist(), "scores": self.scores.tolist(), "extra_logs": logs,
                "skipped": self.skipped.tolist(), "skip_reasons": list(self.skip_reasons)}


@runtime_checkable
class RewardSource(Protocol):
    """Computes rewards for a whole rollout batch in ONE call.

    queries: B prompt+response texts; prompts: B prompt texts; labels: B ground-truth labels (or
    None). kwargs: extra per-batch data a source may use (e.g. `sequences` / `attention_mask` token
    ids for a reward model); sources ignore what they do not use."""

    def score(self, queries: list[str], prompts: list[str], labels: list | None = None,
              **kwargs) -> RewardResult: ...

    def close(self) -> None: ...


def check_batch(queries, prompts, labels) -> int:
    """Return B = len(queries) after checking that prompts / labels (when given) have B entries."""
    if isinstance(queries, str) or not isinstance(queries, (list, tuple)):
        raise TypeError(f"queries must be a list of B strings, got {type(queries).__name__}")
    n = len(queries)
    for name, values in (("prompts", prompts), ("labels", labels)):
        if values is None:
            continue
        if isinstance(values, str) or not hasattr(values, "__len__"):
            raise TypeError(f"{name} must be a list of {n} entries (one per query), got "
                            f"{type(values).__name__}")
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for {n} queries")
    return n


def _describe(value) -> str:
    text = repr(value)
    return (f"{text[:40]}... "
            f"({type(value).__name__})" if len(text) > 40 else f"{text} ({type(value).__name__})")


def reward_scalar(value, what: str, origin: str | None = None) -> float:
    """One reward, score or logged statistic as a float: a real number (int, float, bool, numpy scalar)
    or a one-element torch tensor or numpy array. Anything else raises RewardError
    `<origin>: <what> is <value> (<type>), not a number` (without `origin`: from `<what>` on)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.reshape(()).item())
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return float(value)
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # 0-d / 1-element numpy array
        return reward_scalar(value.item(), what, origin)
    where = f"{origin}: " if origin is not None else ""
    raise RewardError(f"{where}{what} is {_describe(value)}, not a number")


def as_vector(value, n: int, name: str, origin: str) -> torch.Tensor:
    """`value` (list / tuple / numpy array / 1-D tensor of n numbers) → float32 [n]; may hold non-finite
    values (see `nonfinite`). Raises RewardError naming `origin` for a wrong type, shape or length."""
    singular = name[:-1] if name.endswith("s") else name
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu", torch.float32)
    elif hasattr(value, "__array__") and not isinstance(value, (list, tuple)):  # numpy array
        try:
            t = torch.as_tensor(value.__array__().astype("float64"), dtype=torch.float32)
        except (TypeError, ValueError) as err:
            raise RewardError(f"{origin}: {name} is an array of {value.dtype}, not numbers ({err})") from err
    elif isinstance(value, (list, tuple)):
        t = torch.tensor([reward_scalar(v, f"{singular} {i}", origin) for i, v in enumerate(value)],
                         dtype=torch.float32)
    else:
        raise RewardError(f"{origin}: {name} must be a list, tuple, numpy array or 1-D torch tensor of {n} "
                          f"numbers, got {type(value).__name__}")
    if t.dim() != 1:
        raise RewardError(f"{origin}: {name} has shape {tuple(t.shape)}; expected 1-D with {n} values")
    if t.numel() != n:
        raise RewardError(f"{origin}: returned {t.numel()} {name} for {n} samples")
    return t


def nonfinite(t: torch.Tensor, name: str) -> tuple[torch.Tensor, list[str]]:
    """Mask of the non-finite entries of `t` and one message per entry ("reward 3 is NaN")."""
    bad = ~torch.isfinite(t)
    singular = name[:-1] if name.endswith("s") else name
    msgs = [f"{singular} {i} is "
            f"{'NaN' if math.isnan(t[i]) else t[i].item()}" for i in bad.nonzero().flatten().tolist()]
    return bad, msgs


def _extra_logs(logs, n: int, origin: str) -> dict:
    if logs is None:
        return {}
    if not isinstance(logs, dict):
        raise RewardError(f"{origin}: extra_logs must be a dict of name -> number or {n} numbers, "
                          f"got {type(logs).__name__}")
    out = {}
    for key, value in logs.items():
        what = f"extra_logs[{key!r}]"
        is_scalar = (isinstance(value, numbers.Real)
                     or (hasattr(value, "dim") and value.dim() == 0)
                     or (hasattr(value, "ndim") and value.ndim == 0))
        if is_scalar:
            out[str(key)] = reward_scalar(value, what, origin)
            continue
        try:
            out[str(key)] = as_vector(value, n, what, origin)
        except RewardError as err:
            raise RewardError(f"{err}; an extra_logs value is one number or one number per sample") from None
    return out


def parse_output(raw, n: int, origin: str, on_error: str = "raise") -> RewardResult:
    """Validate a raw reward output for n samples (module doc) and build a RewardResult.

    on_error="raise": any problem raises RewardError naming `origin`. on_error="skip": a structural
    problem (wrong type or length, missing key) marks all n samples skipped; non-finite rewards or
    scores mark just those samples. Skipped samples get reward 0 and score 0; the caller counts them.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}: valid values are {list(ON_ERROR)}")
    try:
        result = _parse_structure(raw, n, origin)
    except RewardError as err:
        if on_error == "raise":
            raise
        return skipped_batch(n, str(err))
    bad_r, msgs_r = nonfinite(result.rewards, "rewards")
    scores = result.scores.masked_fill(bad_r, 0.0)  # one message per sample: rewards first
    bad_s, msgs_s = nonfinite(scores, "scores")
    bad = bad_r | bad_s
    if bool(bad.any()):
        msgs = msgs_r + msgs_s
        if on_error == "raise":
            more = f" (and {len(msgs) - _MAX_LISTED} more)" if len(msgs) > _MAX_LISTED else ""
            raise RewardError(f"{origin}: {'; '.join(msgs[:_MAX_LISTED])}{more}; rewards must be finite "
                              f"numbers")
        result.skipped |= bad
        result.skip_reasons += [f"{origin}: {m}" for m in msgs]
    if bool(result.skipped.any()):
        result.rewards[result.skipped] = 0.0
        result.scores[result.skipped] = 0.0
    return result


def _parse_structure(raw, n: int, origin: str) -> RewardResult:
    if not isinstance(raw, dict):
        if isinstance(raw, (list, tuple, torch.Tensor)) or hasattr(raw, "__array__"):
            return RewardResult(as_vector(raw, n, "rewards", origin))
        raise RewardError(f"{origin}: returned {type(raw).__name__}; expected a dict with a 'rewards' key "
                          f"(and optional 'scores', 'extra_logs') or a sequence of {n} rewards")
    if "rewards" not in raw:
        raise RewardError(f"{origin}: returned a dict without a 'rewards' key (keys: "
                          f"{sorted(map(str, raw))}); expected {{'rewards': {n} numbers, 'scores': optional, "
                          f"'extra_logs': optional}}")
    rewards = as_vector(raw["rewards"], n, "rewards", origin)
    scores = None if raw.get("scores") is None else as_vector(raw["scores"], n, "scores", origin)
    skipped = None
    if raw.get("skipped") is not None:
        skipped = as_vector(raw["skipped"], n, "skipped", origin).bool()
    reasons = [str(r) for r in raw.get("skip_reasons") or []]
    return RewardResult(rewards, scores, _extra_logs(raw.get("extra_logs"), n, origin), skipped, reasons)


def skipped_batch(n: int, reason: str) -> RewardResult:
    """All n samples skipped (rewards and scores 0) because of `reason`."""
    return RewardResult(torch.zeros(n), torch.zeros(n), {}, torch.ones(n, dtype=torch.bool), [reason])


def contiguous_chunks(n: int, parts: int) -> list[range]:
    """`range(n)` cut into `parts` contiguous, nearly equal chunks: each holds n // parts samples and
    the first n % parts chunks one more (a chunk is empty when n < parts)."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(range(start, end))
        start = end
    return out


def concat_results(parts: list[RewardResult]) -> RewardResult:
    """The results of consecutive chunks of one batch, as one result in the same order: rewards,
    scores, skipped and per-sample extra_logs concatenated; a batch statistic (a number in every
    part) becomes the mean over the parts weighted by their sizes; a name that is per-sample in some
    parts and a number in others is per-sample throughout (the number repeated over its part's
    samples). A name missing from some part raises RewardError."""
    if not parts:
        return RewardResult(rewards=torch.zeros(0))
    if len(parts) == 1:
        return parts[0]
    logs = {}
    names = dict.fromkeys(k for p in parts for k in p.extra_logs)
    for key in names:
        missing = [i for i, p in enumerate(parts) if key not in p.extra_logs]
        if missing:
            raise RewardError(f"extra_logs[{key!r}] is logged for some chunks of the batch and not for "
                              f"chunk(s) {missing}; every reward server must log the same names")
        values = [p.extra_logs[key] for p in parts]
        if all(not isinstance(v, torch.Tensor) for v in values):
            total = sum(len(p) for p in parts)
            logs[key] = float(sum(float(v) * len(p) for v, p in zip(values, parts)) / max(total, 1))
        else:
            logs[key] = torch.cat([v if isinstance(v, torch.Tensor) else torch.full((len(p),), float(v))
                                   for v, p in zip(values, parts)])
    return RewardResult(rewards=torch.cat([p.rewards for p in parts]),
                        scores=torch.cat([p.scores for p in parts]), extra_logs=logs,
                        skipped=torch.cat([p.skipped for p in parts]),
                        skip_reasons=[r for p in parts for r in p.skip_reasons])
