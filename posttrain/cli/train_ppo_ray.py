"""`python -m posttrain.cli.train_ppo_ray` / `posttrain ppo` — RL from a reward (PPO, REINFORCE++,
RLOO, GRPO, Dr.GRPO; flags: OpenRLHF 0.10.2 names). Runs its roles in one process for now."""
from __future__ import annotations

import sys

from posttrain.cli.errors import user_errors


def main(argv: list[str] | None = None, prog: str = "posttrain ppo") -> dict:
    from posttrain.config import parse_config

    with user_errors(prog):
        cfg = parse_config("ppo", sys.argv[1:] if argv is None else argv)
        from posttrain.trainers.rl.ppo import train_rl

        return train_rl(cfg)


if __name__ == "__main__":
    main()
