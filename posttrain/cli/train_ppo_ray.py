"""`python -m posttrain.cli.train_ppo_ray` / `posttrain ppo` — RL from a reward (PPO, REINFORCE++,
RLOO, GRPO, Dr.GRPO; flags: OpenRLHF 0.10.2 names). Runs its roles in one process for now."""
from __future__ import annotations

from posttrain.cli.errors import run_trainer


def main(argv: list[str] | None = None, prog: str = "posttrain ppo") -> dict:
    return run_trainer("ppo", argv, prog)


if __name__ == "__main__":
    main()
