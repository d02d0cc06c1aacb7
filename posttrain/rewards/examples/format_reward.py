"""A format reward in TRL's convention (it names `completions`, so it is called by keyword): 1 when the
response is a bare integer (as the synthetic arithmetic task asks), else 0. A second term beside
`arithmetic_reward.py` with `--reward.func_path` ([Rewards](docs/rewards.md#several-rewards))."""
import re


def reward_func(completions, **kwargs):
    return [1.0 if re.fullmatch(r"\s*-?\d+\s*", c) else 0.0 for c in completions]
