"""`python -m posttrain.cli.train_dpo` — DPO / IPO / cDPO on preference pairs (flags: OpenRLHF 0.10.2 names).

Several processes: `torchrun --nproc_per_node 2 -m posttrain.cli.train_dpo ...` or
`deepspeed --num_gpus 2 --module posttrain.cli.train_dpo ...` (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import sys

from posttrain.cli.errors import user_errors


def main(argv: list[str] | None = None, prog: str = "posttrain dpo") -> dict:
    from posttrain.config import parse_config

    with user_errors(prog):
        cfg = parse_config("dpo", sys.argv[1:] if argv is None else argv)
        from posttrain.trainers.dpo import train_dpo

        return train_dpo(cfg)


if __name__ == "__main__":
    main()
