"""`posttrain init-tiny --output DIR`: build a tiny random-init model and a locally trained
tokenizer in Hugging Face format (no download), for tests, demos and debugging."""
from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> dict:
    from posttrain.models import PRESETS, build_tiny

    p = argparse.ArgumentParser(prog="posttrain init-tiny", description=__doc__)
    p.add_argument("--output", required=True, help="folder to write the model and tokenizer into")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    p.add_argument("--size", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--head", default="lm", choices=["lm", "score"],
                   help="lm: causal LM; score: sequence-classification model (reward/critic)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    summary = build_tiny(args.output, arch=args.arch, size=args.size, head=args.head, seed=args.seed)
    print(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    main()
