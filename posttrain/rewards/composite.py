"""Several reward sources as one (`--reward.func_path F [F ...]`, `--reward.func_weights W [W ...]`, and
beside them `--reward.model_name_or_path` / `--reward.remote_url` weighted by `--reward.model_weight`): a
sample's reward is the weighted sum of its terms, as TRL's `reward_funcs` / `reward_weights`.

Term names: a `FILE.py` term is named by the file's stem, a `FILE.py:NAME` term by NAME, the reward
model's term `model`, a reward server's or `--reward.remote_url FILE.py`'s term `remote`. A function
that returns a dict without a `rewards` key returns named terms, `{name: B values}`: each is a term of
that name, weighted by the function's weight. A value None means "does not apply to this sample" (TRL):
it adds nothing to the sum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.config.roles import RESERVED_TERM_NAMES, reward_func_spec
from posttrain.rewards.python_func import PythonRewardFunction
from posttrain.rewards.result import RewardError, RewardResult, check_batch
from posttrain.utils.log import warn_once


@dataclass
class Term:
    """One weighted reward source; `source` is a PythonRewardFunction or any RewardSource."""

    name: str
    source: object
    weight: float = 1.0


def function_terms(entries: list[str], weights: list[float] | None = None, **kwargs) -> list[Term]:
    """The `--reward.func_path` entries (`config.roles.reward_func_spec`) as terms, loaded now, weighted by
    `weights` (None: 1 each); kwargs go to each PythonRewardFunction (on_error, timeout, retries, ...)."""
    weights = [1.0] * len(entries) if weights is None else list(weights)
    if len(weights) != len(entries):
        raise RewardError(f"--reward.func_weights has {len(weights)} weights for {len(entries)} "
                          "--reward.func_path files")
    terms = []
    for entry, weight in zip(entries, weights):
        path, function, name = reward_func_spec(entry)
        terms.append(Term(name, PythonRewardFunction(path, function=function, **kwargs), float(weight)))
    return terms


def combine(functions: list[Term], main=None, main_name: str = "model", main_weight: float = 1.0):
    """`main` alone when there are no function terms (None when there is neither); else a CompositeReward
    of the function terms followed by `main` (when given) as the term `main_name`."""
    if not functions:
        return main
    main_term = [Term(main_name, main, float(main_weight))] if main is not None else []
    return CompositeReward(functions + main_term)


def _nones(values) -> tuple[object, torch.Tensor | None]:
    """(values with each None as 0.0, bool mask of the Nones) for a list or tuple; (values, None) else."""
    if not isinstance(values, (list, tuple)) or not any(v is None for v in values):
        return values, None
    return [0.0 if v is None else v for v in values], torch.tensor([v is None for v in values])


class CompositeReward:
    """RewardSource summing weighted terms per sample (module docstring), in term order, in float32.

    score(queries, prompts, labels, sequence_ids=None, **kwargs): each function term is called with the
    kwargs (`PythonRewardFunction.call`); a term with `score_tokens` (a reward model, or a Ray reward
    group) scores `sequence_ids` (the token ids as sampled) when given, any other term `score(queries,
    prompts, labels)`. The result: rewards and scores = sum of weight x the term's rewards / scores (a
    None adds nothing); skipped = skipped by any term of weight != 0 (its reward and score then 0, as a
    single source's; a weight-0 term's skips only leave its own metric out);
    extra_logs: `<name>` -> the term's own values, unweighted (NaN where None or skipped: the metric is
    the mean of the others), `<name>/<key>` -> the term's own extra_logs. A term named twice, or by a
    reserved name (`config.roles.RESERVED_TERM_NAMES`), raises RewardError. Errors of a term follow its
    source's own on_error (`--reward.skip_errors_enable`)."""

    def __init__(self, terms: list[Term]):
        if not terms:
            raise ValueError("CompositeReward needs at least one term")
        self.terms = list(terms)
        self.takes_columns = True  # `rollout.single_turn.reward_kwargs`
        self.needs_token_ids = any(hasattr(t.source, "score_tokens") for t in self.terms)

    def score(self, queries, prompts, labels=None, sequence_ids=None, **kwargs) -> RewardResult:
        n = check_batch(queries, prompts, labels)
        parts = []
        for term in self.terms:
            parts += self._parts(term, n, queries, prompts, labels, sequence_ids, kwargs)
        return _sum(parts, n)

    def _parts(self, term: Term, n: int, queries, prompts, labels, sequence_ids, kwargs) -> list[tuple]:
        """[(name, weight, RewardResult, mask of the Nones or None)] of one term (several for a function
        returning named terms)."""
        src = term.source
        if not isinstance(src, PythonRewardFunction):
            if sequence_ids is not None and hasattr(src, "score_tokens"):
                return [(term.name, term.weight, src.score_tokens(sequence_ids), None)]
            return [(term.name, term.weight, src.score(queries, prompts, labels), None)]
        raw = src.call(queries, prompts, labels, **kwargs)
        if isinstance(raw, RewardResult):  # every attempt failed, skipped on request
            return [(term.name, term.weight, src.counted(raw, n), None)]
        if isinstance(raw, dict) and raw and "rewards" not in raw:  # named terms
            out = []
            for key, values in raw.items():
                if str(key) in RESERVED_TERM_NAMES:
                    raise RewardError(f"{src.origin} returned a term named {key!r}, a reserved name "
                                      f"(reward/{key} is another metric or source); rename the key")
                values, missing = _nones(values)
                result = src.parse(values, n, f"{src.origin} (term {key!r})")
                out.append((str(key), term.weight, src.counted(result, n), missing))
            return out
        if isinstance(raw, dict):
            rewards, missing = _nones(raw["rewards"])
            raw = {**raw, "rewards": rewards}
        else:
            raw, missing = _nones(raw)
        return [(term.name, term.weight, src.counted(src.parse(raw, n), n), missing)]

    def close(self) -> None:
        for term in self.terms:
            term.source.close()

    def __repr__(self) -> str:
        return "CompositeReward(" + ", ".join(f"{t.name}={t.weight:g}x{t.source!r}" for t in self.terms) + ")"


def _sum(parts: list[tuple], n: int) -> RewardResult:
    """The weighted sum of the parts (`CompositeReward`), with their logs."""
    rewards = scores = None
    skipped = torch.zeros(n, dtype=torch.bool)
    applies = torch.zeros(n, dtype=torch.bool)
    logs, reasons = {}, []
    for name, weight, result, missing in parts:
        if name in logs:
            raise RewardError(f"two reward terms are named {name!r} (reward/{name}); rename a function, a "
                              "file or a key of a returned dict")
        missing = torch.zeros(n, dtype=torch.bool) if missing is None else missing
        r = result.rewards.masked_fill(missing, 0.0) * weight
        s = result.scores.masked_fill(missing, 0.0) * weight
        rewards = r if rewards is None else rewards + r
        scores = s if scores is None else scores + s
        if weight != 0:  # a weight-0 term is logged only: its skips cost no sample its reward
            skipped |= result.skipped
            reasons += result.skip_reasons
        applies |= ~missing
        logs[name] = result.rewards.masked_fill(missing | result.skipped, float("nan"))
        logs.update({f"{name}/{k}": v for k, v in result.extra_logs.items()})
    if not bool(applies.all()):
        warn_once(f"{int((~applies).sum())} sample(s) got None from every reward term: reward 0")
    rewards, scores = rewards.masked_fill(skipped, 0.0), scores.masked_fill(skipped, 0.0)
    return RewardResult(rewards, scores, logs, skipped, reasons)
