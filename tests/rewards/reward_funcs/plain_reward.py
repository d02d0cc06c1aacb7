"""Test reward function in OpenRLHF's example style: reward = 1.0 when the response (query minus its
prompt) contains the label, else 0.0; extra_logs carries the response length per sample."""
import torch

CALLS = []  # one entry per call: the batch size it was called with


def reward_func(queries, prompts, labels, **kwargs):
    # queries are prompt + response texts, labels the dataset's ground-truth answers
    CALLS.append(len(queries))
    responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    reward = torch.tensor([float(str(label) in r) for r, label in zip(responses, labels)])
    lengths = torch.tensor([float(len(r)) for r in responses])
    return {"rewards": reward, "scores": reward, "extra_logs": {"response_chars": lengths}}
