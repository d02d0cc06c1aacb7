"""`posttrain init-tiny --output DIR`: build a tiny random-init model and a locally trained
tokenizer in Hugging Face format (no download), for tests, demos and debugging."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from posttrain.cli.errors import user_errors
from posttrain.utils.errors import UserError

PROG = "posttrain init-tiny"


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse (UserError) an --output that is a file, or a folder that holds files unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file, not a folder; choose a new or empty folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--output {out} is not empty; choose a new or empty folder, or pass --overwrite to "
                        "replace its contents")


def main(argv: list[str] | None = None) -> dict:
    from posttrain.models import PRESETS, build_tiny

    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--output", required=True, help="folder to write the model and tokenizer into")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    p.add_argument("--size", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--head", default="lm", choices=["lm", "score"],
                   help="lm: causal LM; score: sequence-classification model (reward/critic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --output")
    args = p.parse_args(argv)
    with user_errors(PROG):
        check_output(Path(args.output), args.overwrite)
        summary = build_tiny(args.output, arch=args.arch, size=args.size, head=args.head, seed=args.seed,
                             overwrite=args.overwrite)
    print(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    main()
