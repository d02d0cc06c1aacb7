"""Verifiable reward for the synthetic colour task (`posttrain.data.synthetic_vision`): 1 when the first word
of the response is the colour in the label, else 0. Usable as `--reward.remote_url <this file>`."""
import re

import torch


def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    words = [re.findall(r"[a-z]+", r.lower())[:1] for r in responses]
    rewards = torch.tensor([1.0 if w and w[0] == str(label) else 0.0 for w, label in zip(words, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": rewards}}
