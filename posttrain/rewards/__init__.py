"""Reward sources: a `reward_func` Python file, a reward model, or an HTTP reward server, all behind
one batched interface `score(queries, prompts, labels, **kwargs) -> RewardResult`."""
from posttrain.rewards.pick_source import make_reward_source
from posttrain.rewards.python_func import PythonRewardFunction
from posttrain.rewards.remote import TOKEN_ENV, RemoteReward, ShardedRemoteReward
from posttrain.rewards.result import RewardError, RewardResult, RewardSource, parse_output
from posttrain.rewards.reward_model import RewardModelSource

__all__ = [
    "TOKEN_ENV", "PythonRewardFunction", "RemoteReward", "RewardError", "RewardModelSource", "RewardResult",
    "RewardSource", "ShardedRemoteReward", "make_reward_source", "parse_output",
]
