"""Distributed (multi-process, Ray) RL runs: role placement and the plumbing between ranks."""
