"""Reward file (`--reward.remote_url`) for the tool environments shipped here (`calculator_tools.py`,
`calculator_env.py`, `kv_search_tools.py`): 1 when the model's final answer, its last turn without the
chat template's end-of-turn tokens, is the row's label (whitespace around it ignored), else 0. A tool
episode's reward source sees the prompt followed by that final turn only (docs/agents.md, Tool
environments)."""
import torch

END_TOKENS = ("<|im_end|>", "<|endoftext|>")  # the tiny models' ChatML end-of-turn and padding tokens


def final_answer(response: str) -> str:
    for token in END_TOKENS:
        response = response.replace(token, "")
    return response.strip()


def reward_func(queries, prompts, labels, **kwargs):
    rewards = torch.tensor([float(final_answer(q[len(p):]) == str(label).strip())
                            for q, p, label in zip(queries, prompts, labels)])
    return {"rewards": rewards, "scores": rewards}
