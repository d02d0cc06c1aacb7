"""Evaluation rollouts: `--eval.n_samples_per_prompt` samples per prompt at `--eval.temperature`.
pass1 = mean reward over all samples; pass<k> = mean over prompts of the best of its k samples
(for 0/1 verifiable rewards: the fraction of prompts solved at least once)."""
from __future__ import annotations

from pathlib import Path


def eval_metrics(executor, prompts, params, name: str, max_len: int | None = None) -> dict[str, float]:
    """`max_len`: per-sample budgets as in training (`SingleTurnSampler.run`)."""
    scored = executor.run(list(prompts), params, max_len=max_len)
    k = params.n
    r = scored.rewards.view(-1, k)
    out = {f"eval_{name}_pass1": float(r.mean())}
    if k > 1:
        out[f"eval_{name}_pass{k}"] = float(r.max(dim=1).values.mean())
    out[f"eval_{name}_response_length"] = sum(len(x.output_ids)
                                              for x in scored.rollouts) / len(scored.rollouts)
    return out


def dataset_name(path: str) -> str:
    first = path.split(",")[0].rstrip("/")
    return Path(first).stem or "default"
