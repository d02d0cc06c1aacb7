"""Reward functions shipped with posttrain, in OpenRLHF's `reward_func` file format."""
from pathlib import Path

ARITHMETIC = str(Path(__file__).with_name("arithmetic_reward.py"))
