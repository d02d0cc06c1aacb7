"""A reward for examples/data/prompts.jsonl: partial credit for a number near the answer.

The exact-match reward (posttrain/rewards/examples/arithmetic_reward.py) pays only a right answer, which a
model after a very short SFT rarely gives, so most groups of samples score all 0 and teach nothing. This one
pays 1 for the right answer and less the further off the response's last number is (0 from `SCALE` away,
and for no number), so RL has a signal from its first step. Usable as `--reward.remote_url <this file>`.
"""
import torch

from posttrain.data.synthetic import extract_answer

SCALE = 100  # an answer this far off (or further) earns 0


def closeness(response: str, answer: str) -> float:
    """1 - |got - answer| / SCALE, floored at 0; 0 when the response holds no integer."""
    got = extract_answer(response)
    return 0.0 if got is None else max(0.0, 1.0 - abs(int(got) - int(answer)) / SCALE)


def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p):] for q, p in zip(queries, prompts)]
    rewards = torch.tensor([closeness(r, str(label)) for r, label in zip(responses, labels)])
    exact = torch.tensor([float(closeness(r, str(a)) == 1.0) for r, a in zip(responses, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": exact}}
