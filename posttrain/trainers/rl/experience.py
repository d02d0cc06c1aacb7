"""Token-in, token-out experience: the exact sampled tokens laid out as training tensors.

Row i of a batch is `prompt_i + output_i`, right-padded to T. Per-token tensors have T-1 columns,
aligned with the shifted targets: column t scores token t+1 given tokens ≤ t. `action_mask[i, t]`
is 1 exactly when token t+1 is one the policy sampled (positions P_i-1 … P_i+R_i-2), so the last
action column is the last generated token whatever the padding, the pad id or eos ids; tokens are
never rewritten. A multi-turn sample's `Rollout.action_mask` keeps environment-feedback tokens
inside the sequence but out of the action mask (and so out of every loss and statistic). A
vision-language sample keeps its prompt's image tensors (`image_inputs`, one dict per row), which
`model_batch` merges for every forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.data.collate import merge_image_inputs
from posttrain.rollout.single_turn import Rollout


@dataclass
class Experience:
    """Training tensors for a rollout batch; `B` rows, per-token tensors `[B, T-1]`."""
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    rollout_logp: torch.Tensor
    rewards: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    info: dict = field(default_factory=dict)
    image_inputs: list[dict | None] | None = None  # per row: its prompt's image tensors (numpy; None: text)

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def select(self, rows: torch.Tensor | list[int]) -> Experience:
        """Rows `rows`, trimmed to their longest sequence (less padding to compute on)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.attention_mask[rows].sum(1).max())
        def cut(t, per_token=True):
            if t is None:
                return None
            t = t[rows]
            return t[:, : width - 1] if per_token else t
        return Experience(
            sequences=self.sequences[rows][:, :width], attention_mask=self.attention_mask[rows][:, :width],
            action_mask=cut(self.action_mask), rollout_logp=cut(self.rollout_logp),
            rewards=self.rewards[rows], old_logp=cut(self.old_logp), ref_logp=cut(self.ref_logp),
            values=cut(self.values), kl=cut(self.kl), advantages=cut(self.advantages),
            returns=cut(self.returns),
            image_inputs=None if self.image_inputs is None else [self.image_inputs[r] for r in rows.tolist()])

    def model_batch(self) -> dict:
        batch = {"input_ids": self.sequences, "attention_mask": self.attention_mask}
        images = merge_image_inputs(self.image_inputs or [], self.sequences.device)
        return {**batch, "image_inputs": images} if images else batch


def build_experience(rollouts: list[Rollout], rewards: torch.Tensor, pad_id: int) -> Experience:
    """Lay out `rollouts` (group-contiguous) as right-padded training tensors."""
    lengths = [len(r.prompt_ids) + len(r.output_ids) for r in rollouts]
    width = max(lengths)
    b = len(rollouts)
    seq = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    action = torch.zeros((b, width - 1), dtype=torch.float32)
    rollout_logp = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        p, n = len(r.prompt_ids), len(r.output_ids)
        if len(r.rollout_logprobs) != n:
            raise ValueError(f"sample {i}: {n} output tokens but {len(r.rollout_logprobs)} log-probs from "
                             f"the rollout engine")
        seq[i, : p + n] = torch.tensor(r.prompt_ids + r.output_ids, dtype=torch.long)
        attn[i, : p + n] = 1
        if r.action_mask is not None and len(r.action_mask) != n:
            raise ValueError(f"sample {i}: {n} output tokens but an action mask of {len(r.action_mask)}")
        if n:
            action[i,
                   p - 1: p - 1 + n] = (1.0 if r.action_mask is None
                                        else torch.tensor(r.action_mask, dtype=torch.float32))
            rollout_logp[i, p - 1: p - 1 + n] = torch.tensor(r.rollout_logprobs, dtype=torch.float32)
    images = [r.image_inputs for r in rollouts]
    return Experience(sequences=seq, attention_mask=attn, action_mask=action, rollout_logp=rollout_logp,
                      rewards=rewards.float(),
                      image_inputs=images if any(im is not None for im in images) else None)
