"""`posttrain lora-merge` / `python -m posttrain.cli.lora_combiner`: merge a LoRA adapter saved by
`posttrain sft|rm|dpo|ppo --ds.lora.rank N` into its base model, giving a standalone Hugging Face
folder (W ← W + alpha/rank · B A) that loads with plain `from_pretrained`, no peft needed."""
from __future__ import annotations

import argparse
import sys

from posttrain.cli.exits import user_errors

PROG = "posttrain lora-merge"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--model_path", default=None,
                   help="base model folder or hub id (default: the adapter's base_model_name_or_path)")
    p.add_argument("--lora_path", required=True,
                   help="adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--output_path", required=True, help="folder to write the merged model and tokenizer into")
    p.add_argument("--is_rm", action="store_true", default=None,
                   help="merge a reward model (score head, AutoModelForSequenceClassification); "
                        "default: detected from the adapter's task type")
    p.add_argument("--ds.param_dtype", dest="param_dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="dtype the base is loaded, merged and saved in (default bf16, as OpenRLHF)")
    p.add_argument("--ds.value_head_prefix", dest="value_head_prefix", default="score",
                   help="reward models: the score head's tensor name, read from the base when the "
                        "adapter carries no head and written to the merged model (default score)")
    return p


def main(argv: list[str] | None = None) -> str:
    """Parse flags, merge, print and return the output folder. Bad input exits with status 2."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    from posttrain.config import ConfigError
    from posttrain.models.folders import check_merge_paths

    with user_errors(PROG):
        try:
            check_merge_paths(args.lora_path, args.output_path, args.model_path)  # before torch loads
            from posttrain.models import merge_lora

            merge_lora(args.lora_path, args.output_path, base_path=args.model_path, dtype=args.param_dtype,
                       is_rm=args.is_rm, value_head_prefix=args.value_head_prefix)
        except ValueError as e:  # the models layer's clear bad-input errors
            raise ConfigError(str(e)) from None
    print(args.output_path)
    return str(args.output_path)


if __name__ == "__main__":
    main()
