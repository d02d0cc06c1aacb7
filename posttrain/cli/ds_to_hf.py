"""`posttrain ds-to-hf` / `python -m posttrain.cli.ds_to_hf`: a DeepSpeed ZeRO checkpoint (stage 1-3, written
by OpenRLHF, posttrain or any DeepSpeed run) as a plain Hugging Face folder, read safely (no unpickling of
anything but tensors and DeepSpeed's plain types), or posttrain's own one-process checkpoint (`global_stepN`)
as one. The output is written atomically into a new or empty folder (`--overwrite` replaces a non-empty one),
never into a posttrain checkpoint or run folder. To resume training on another layout, posttrain's own
checkpoints need no conversion (docs/runs.md, elastic resume)."""
from __future__ import annotations

import argparse
import sys

from posttrain.cli.exits import user_errors

PROG = "posttrain ds-to-hf"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--checkpoint", required=True,
                   help="the folder holding tag folders (with a `latest` file, e.g. OpenRLHF's "
                        "ckpt_path/_actor) or one tag folder (global_step100)")
    p.add_argument("--tag", default=None, help="the tag folder to read (default: `latest`)")
    p.add_argument("--model_path", required=True, help="the base model folder the run started from "
                                                       "(architecture, tokenizer)")
    p.add_argument("--output_path", required=True,
                   help="a new or empty folder to write the model and tokenizer into (never one inside a "
                        "posttrain checkpoint or run folder)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output_path when it is not empty (its old content is deleted once the new "
                        "model is in place)")
    p.add_argument("--is_rm", action="store_true", help="a reward model or critic (score head)")
    p.add_argument("--ds.param_dtype", dest="param_dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="dtype of the saved weights (default bf16)")
    return p


def main(argv: list[str] | None = None) -> str:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from posttrain.models.deepspeed_export import (
        check_output_folder,
        checkpoint_source,
        export_zero_checkpoint,
    )
    from posttrain.models.folders import check_model_folder

    with user_errors(PROG):
        check_output_folder(args.output_path, args.overwrite)  # every path, before torch and transformers
        check_model_folder(args.model_path)
        checkpoint_source(args.checkpoint, args.tag)
        out = export_zero_checkpoint(args.checkpoint, args.model_path, args.output_path, tag=args.tag,
                                     dtype=args.param_dtype, score=args.is_rm, overwrite=args.overwrite)
    print(out)
    return str(out)


if __name__ == "__main__":
    main()
