"""Process reward models (PRM): a causal LM that scores every reasoning step of a text.

A PRM reads a text in which each step ends with a placeholder token (Math-Shepherd's ``ки``) and predicts,
at each placeholder position, the label token that follows it: its logits there, restricted to the reward
tokens ``R = (r_0, ..., r_{K-1})`` (e.g. ``+`` ``-``; all of the vocabulary when none are given), are
``z ∈ R^K`` per step. As OpenRLHF 0.9's ``PRMLoss``:

- hard label (a reward-token index ``y``): ``ℓ = −log softmax(z)_y``;
- soft label (``p ∈ [0, 1]`` the probability that the step is good; two reward tokens, the good one first):
  ``ℓ = −(p log s_0 + (1 − p) log s_1)`` with ``s = softmax(z)``;
- `prm_loss` is ``Σ_steps ℓ / N``, ``N`` the steps of the whole optimizer step (default: the local count),
  so how a step is split into micro-batches and ranks does not change it (OpenRLHF: the micro-batch mean).

A step's score is ``softmax(z)_0``: the probability of the first (good) reward token (`step_scores`).
`render_steps` is the one text layout of steps and placeholders, used to train on step lists (TRL's
``prompt`` / ``completions`` / ``labels`` rows) and to score a policy's response in RL.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._util import check_ndim, f32


def render_steps(prompt: str, steps: list[str], placeholder: str, separator: str = "\n") -> str:
    """``prompt + separator.join(step + " " + placeholder for step in steps)``: each step followed by a
    space and the placeholder (Math-Shepherd's ``"Step 1: ... ки\\nStep 2: ... ки"``)."""
    return rendered_steps(prompt, steps, placeholder, separator)[0]


def rendered_steps(prompt: str, steps: list[str], placeholder: str,
                   separator: str = "\n") -> tuple[str, list[int]]:
    """`render_steps`' text and the character offset of each step's placeholder in it."""
    if not placeholder:
        raise ValueError("placeholder must be a non-empty token")
    text, offsets = prompt, []
    for i, step in enumerate(steps):
        text += (separator if i else "") + step + " "
        offsets.append(len(text))
        text += placeholder
    return text, offsets


def placeholder_logits(logits: torch.Tensor, input_ids: torch.Tensor, placeholder_id: int,
                       reward_token_ids: list[int] | None = None) -> torch.Tensor:
    """The logits ``[S, K]`` at every placeholder position of ``input_ids [B, L]`` (row-major order, S the
    placeholders of the batch) from ``logits [B, L, V]`` (the position's own logits: they predict the token
    after the placeholder), restricted to ``reward_token_ids`` (K = their count; None: K = V)."""
    check_ndim("logits", logits, 3, "[B, L, V]")
    check_ndim("input_ids", input_ids, 2, "[B, L]")
    if tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} must share "
                         "[B, L]")
    picked = logits[input_ids == placeholder_id]
    if reward_token_ids is not None:
        if len(reward_token_ids) < 2:
            raise ValueError(f"reward_token_ids={reward_token_ids!r}: a PRM needs at least two reward tokens")
        picked = picked[:, list(reward_token_ids)]
    return picked


def _check_labels(step_logits: torch.Tensor, labels: torch.Tensor) -> bool:
    """True for soft labels (float probabilities of the first reward token), False for hard (indices)."""
    check_ndim("step_logits", step_logits, 2, "[S, K]")
    check_ndim("labels", labels, 1, "[S]")
    if labels.shape[0] != step_logits.shape[0]:
        raise ValueError(f"labels has {labels.shape[0]} steps but step_logits {step_logits.shape[0]}")
    soft = labels.is_floating_point()
    if soft:
        if step_logits.shape[1] != 2:
            raise ValueError(f"soft labels need exactly two reward tokens (good, bad), got "
                             f"{step_logits.shape[1]}")
        if bool(((labels < 0) | (labels > 1)).any()):
            raise ValueError("soft labels must be probabilities in [0, 1]")
    elif bool(((labels < 0) | (labels >= step_logits.shape[1])).any()):
        raise ValueError(f"hard labels must be reward-token indices in [0, {step_logits.shape[1]})")
    return soft


def prm_loss(step_logits: torch.Tensor, labels: torch.Tensor, num_steps: float | None = None) -> torch.Tensor:
    """``Σ_steps ℓ / num_steps`` (float32 scalar; module doc) of ``step_logits [S, K]`` and ``labels [S]``:
    int64 reward-token indices (hard) or float probabilities of the first token (soft, K = 2).
    ``num_steps`` defaults to S (the local mean); 0 steps give 0 (with a gradient path)."""
    soft = _check_labels(step_logits, labels)
    log_s = F.log_softmax(f32(step_logits), dim=-1)
    if soft:
        p = f32(labels)
        per_step = -(p * log_s[:, 0] + (1 - p) * log_s[:, 1])
    else:
        per_step = -log_s.gather(1, labels.long().unsqueeze(1)).squeeze(1)
    n = per_step.shape[0] if num_steps is None else num_steps
    return per_step.sum() / max(float(n), 1.0)


def prm_correct(step_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per step, 1.0 where the argmax reward token is the label (soft labels: the token of probability
    ≥ 0.5, the first on a tie), else 0.0: ``[S]`` float32 (OpenRLHF's ``acc`` is their mean)."""
    soft = _check_labels(step_logits, labels)
    target = (labels < 0.5).long() if soft else labels.long()
    return (step_logits.argmax(dim=-1) == target).float()


def step_scores(step_logits: torch.Tensor) -> torch.Tensor:
    """``softmax(z)_0`` per step ``[S]`` float32: the probability of the first (good) reward token."""
    check_ndim("step_logits", step_logits, 2, "[S, K]")
    return F.softmax(f32(step_logits), dim=-1)[:, 0]
