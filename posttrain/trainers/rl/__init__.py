"""Reinforcement learning from a reward (PPO with a critic, REINFORCE++, RLOO, GRPO, Dr.GRPO, ...):
rollouts → experience (log-probs, values, rewards, advantages) → policy/critic updates."""
