"""`python -m posttrain.cli.train_kto` — KTO on unpaired rows (flags: OpenRLHF 0.9's train_kto in the dotted
style of 0.10.2: --model.beta, --model.desirable_weight, --data.label_key, ...).

Several processes: `torchrun --nproc_per_node 2 -m posttrain.cli.train_kto ...` or
`deepspeed --num_gpus 2 --module posttrain.cli.train_kto ...` (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

from posttrain.cli.exits import run_trainer


def main(argv: list[str] | None = None, prog: str = "posttrain kto") -> dict:
    return run_trainer("kto", argv, prog)


if __name__ == "__main__":
    main()
