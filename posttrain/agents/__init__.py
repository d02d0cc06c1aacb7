"""Agents layer: rollout executors, reward sources (reward_func file, reward model, HTTP) and servers."""
