"""Reward sources: a `reward_func` Python file, a reward model, or an HTTP reward server, all behind
one batched interface `score(queries, prompts, labels, **kwargs) -> RewardResult`; several of them as
weighted terms of one `CompositeReward`."""
from posttrain.rewards.composite import CompositeReward, Term, combine, function_terms
from posttrain.rewards.pick_source import make_reward_source
from posttrain.rewards.python_func import PythonRewardFunction
from posttrain.rewards.remote import TOKEN_ENV, RemoteReward, ShardedRemoteReward
from posttrain.rewards.result import RewardError, RewardResult, RewardSource, parse_output
from posttrain.rewards.reward_model import RewardModelSource

__all__ = [
    "TOKEN_ENV", "CompositeReward", "PythonRewardFunction", "RemoteReward", "RewardError",
    "RewardModelSource", "RewardResult", "RewardSource", "ShardedRemoteReward", "Term", "combine",
    "function_terms", "make_reward_source", "parse_output",
]
