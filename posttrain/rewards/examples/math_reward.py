"""The math grader as a reward file: 1 when the response's last `\\boxed{...}` answer equals the label
mathematically (`posttrain.rewards.math_grading`: `0.5` = `\\frac{1}{2}`), else 0. Usable as
`--reward.remote_url <this file>`; `posttrain eval` uses it when no reward is given."""
import torch

from posttrain.rewards.math_grading import extract_boxed_answer, grade_answer


def reward_func(queries, prompts, labels, **kwargs):
    answers = [extract_boxed_answer(q[len(p):]) for q, p in zip(queries, prompts)]
    rewards = torch.tensor([1.0 if grade_answer(a, label) else 0.0 for a, label in zip(answers, labels)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"accuracy": rewards}}
