"""`python -m posttrain.cli.train_dpo` — DPO / IPO / cDPO on preference pairs (flags: OpenRLHF 0.10.2 names).

Several processes: `torchrun --nproc_per_node 2 -m posttrain.cli.train_dpo ...` or
`deepspeed --num_gpus 2 --module posttrain.cli.train_dpo ...` (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

from posttrain.cli.exits import run_trainer


def main(argv: list[str] | None = None, prog: str = "posttrain dpo") -> dict:
    return run_trainer("dpo", argv, prog)


if __name__ == "__main__":
    main()
