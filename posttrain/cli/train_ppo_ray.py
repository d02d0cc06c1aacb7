"""`python -m posttrain.cli.train_ppo_ray` / `posttrain ppo` — RL from a reward (PPO, REINFORCE++,
RLOO, GRPO, Dr.GRPO; flags: OpenRLHF 0.10.2 names). Runs its roles in this process, or as Ray actor
groups when a role has several ranks, vLLM engines are asked for or RAY_ADDRESS is set
(`config.ray_mode.uses_ray`, `trainers/rl/placement`)."""
from __future__ import annotations

from posttrain.cli.exits import run_trainer


def main(argv: list[str] | None = None, prog: str = "posttrain ppo") -> dict:
    return run_trainer("ppo", argv, prog)


if __name__ == "__main__":
    main()
