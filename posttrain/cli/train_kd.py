"""`python -m posttrain.cli.train_kd` — knowledge distillation from a frozen teacher (flags: SFT's, as
OpenRLHF 0.10.2 names them, and OpenRLHF 0.9 train_kd's teacher and kd_coef).

Several processes: `torchrun --nproc_per_node 2 -m posttrain.cli.train_kd ...` or
`deepspeed --num_gpus 2 --module posttrain.cli.train_kd ...` (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

from posttrain.cli.exits import run_trainer


def main(argv: list[str] | None = None, prog: str = "posttrain kd") -> dict:
    return run_trainer("kd", argv, prog)


if __name__ == "__main__":
    main()
