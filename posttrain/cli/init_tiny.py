"""`posttrain init-tiny --output DIR`: build a tiny random-init model and a locally trained
tokenizer in Hugging Face format (no download), for tests, demos and debugging; `--shape NAME`: a
random-init model with the dimensions of a released one, to measure memory and speed at that size."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from posttrain.cli.exits import user_errors
from posttrain.utils.errors import UserError

PROG = "posttrain init-tiny"


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse (UserError) an --output that is a file, or a folder that holds files unless `overwrite`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file, not a folder; choose a new or empty folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--output {out} is not empty; choose a new or empty folder, or pass --overwrite to "
                        "replace its contents")


def check_vision(args) -> None:
    """Refuse (UserError) --vision with a flag it does not combine with."""
    if not args.vision:
        return
    clash = [f for f, bad in (("--shape", args.shape), ("--arch", args.arch),
                              ("--head score", args.head != "lm"), ("--dtype bf16", args.dtype != "fp32"))
             if bad]
    if clash:
        raise UserError(f"--vision builds a tiny Qwen2.5-VL from a --size preset in fp32; drop "
                        f"{', '.join(clash)}")


def check_shape(shape: str | None, size: str | None, arch: str | None) -> None:
    """Refuse (UserError) an unknown --shape, or one given with --size or another --arch."""
    from posttrain.models.shapes import SHAPES

    if shape is None:
        return
    if shape not in SHAPES:
        raise UserError(f"--shape {shape}: unknown shape; known shapes: {', '.join(SHAPES)}")
    if size is not None:
        raise UserError(f"--size {size} and --shape {shape}: give one (a tiny preset or a released model's "
                        f"shape)")
    if arch not in (None, SHAPES[shape].arch):
        raise UserError(f"--arch {arch}: --shape {shape} is a {SHAPES[shape].arch} model")


def main(argv: list[str] | None = None) -> dict:
    from posttrain.models.shapes import PRESETS, SHAPES

    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--output", required=True, help="folder to write the model and tokenizer into")
    p.add_argument("--arch", default=None, choices=["llama", "qwen2", "qwen3_moe"],
                   help="default llama; a --shape sets its own; qwen3_moe: a mixture of experts (as --moe)")
    p.add_argument("--size", default=None, choices=sorted(PRESETS), help="a tiny preset (default tiny)")
    p.add_argument("--shape", default=None, metavar="NAME",
                   help=f"a released model's dimensions and vocabulary, random init: {', '.join(SHAPES)}")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="dtype of the saved weights")
    p.add_argument("--head", default="lm", choices=["lm", "score"],
                   help="lm: causal LM; score: sequence-classification model (reward/critic)")
    p.add_argument("--vision", action="store_true",
                   help="a tiny vision-language model (Qwen2.5-VL: the --size preset's language model, a "
                        "small vision tower, an image processor and the tokenizer with the image tokens)")
    p.add_argument("--moe", action="store_true",
                   help="a mixture-of-experts model (Qwen3-MoE: the --size preset's attention, 4 experts of "
                        "half its MLP width per layer, 2 per token); the same as --arch qwen3_moe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --output")
    args = p.parse_args(argv)
    with user_errors(PROG):
        if args.moe:
            if args.arch not in (None, "qwen3_moe") or args.shape or args.vision:
                raise UserError("--moe builds a tiny Qwen3-MoE from a --size preset; drop --arch / --shape / "
                                "--vision")
            args.arch = "qwen3_moe"
        check_shape(args.shape, args.size, args.arch)
        check_vision(args)
        check_output(Path(args.output), args.overwrite)
        from posttrain.models import build_tiny

        summary = build_tiny(args.output, arch=args.arch, size=args.size, head=args.head, seed=args.seed,
                             overwrite=args.overwrite, shape=args.shape, dtype=args.dtype,
                             vision=args.vision)
    print(json.dumps(summary, indent=1, default=str))
    return summary


if __name__ == "__main__":
    main()
