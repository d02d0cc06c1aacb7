"""`python -m posttrain.cli.train_rm` — reward-model training on preference pairs (flags: OpenRLHF
0.10.2 names).

Several processes: `torchrun --nproc_per_node 2 -m posttrain.cli.train_rm ...` or
`deepspeed --num_gpus 2 --module posttrain.cli.train_rm ...` (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import sys

from posttrain.cli.errors import user_errors


def main(argv: list[str] | None = None, prog: str = "posttrain rm") -> dict:
    from posttrain.config import parse_config

    with user_errors(prog):
        cfg = parse_config("rm", sys.argv[1:] if argv is None else argv)
        from posttrain.trainers.rm import train_rm

        return train_rm(cfg)


if __name__ == "__main__":
    main()
