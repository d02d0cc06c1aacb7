"""Test math reward in the style of OpenRLHF's math_reward_func.py: extract the last
"Answer: <x>" (else the last \\boxed{<x>}) from the response and compare numerically with the label."""
import re

import torch

CALLS = []


def extract(response):
    tags = re.findall(r"Answer:\s*([^\n]+)", response, re.IGNORECASE)
    if tags:
        return tags[-1].strip()
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", response)
    return boxed[-1].strip() if boxed else None


def same_number(pred, gold):
    try:
        return pred is not None and abs(float(pred) - float(gold)) < 1e-6
    except ValueError:
        return pred == str(gold)


def reward_func(queries, prompts, labels, **kwargs):
    CALLS.append(len(queries))
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if isinstance(prompt, str) and prompt in query else query
        rewards.append(1.0 if same_number(extract(response), label) else 0.0)
    rewards = torch.tensor(rewards, dtype=torch.float)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"math_accuracy": rewards.mean()}}
