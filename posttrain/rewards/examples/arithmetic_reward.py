"""Verifiable reward for the synthetic arithmetic task: 1 when the last integer of the response
equals the label, else 0. Usable as `--reward.remote_url <this file>` (OpenRLHF format)."""
import torch

from posttrain.data.synthetic import is_correct


def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    rewards = torch.tensor([1.0 if is_correct(r, str(label)) else 0.0 for r, label in zip(responses, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": rewards}}
