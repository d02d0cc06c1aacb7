"""`python -m posttrain.cli.train_prm` — a process reward model on step-labelled rows (flags: OpenRLHF 0.9's
train_prm in the dotted style of 0.10.2: --model.placeholder_token, --model.reward_tokens, --data.input_key,
--data.label_key, ...).

Several processes: `torchrun --nproc_per_node 2 -m posttrain.cli.train_prm ...` or
`deepspeed --num_gpus 2 --module posttrain.cli.train_prm ...` (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

from posttrain.cli.exits import run_trainer


def main(argv: list[str] | None = None, prog: str = "posttrain prm") -> dict:
    return run_trainer("prm", argv, prog)


if __name__ == "__main__":
    main()
