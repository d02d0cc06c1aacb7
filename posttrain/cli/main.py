"""The `posttrain` console command: `posttrain <command> [flags]`."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "init-tiny": ("posttrain.cli.init_tiny", "build a tiny local model + tokenizer (no download)"),
    "sft": ("posttrain.cli.train_sft", "supervised fine-tuning"),
    "rm": ("posttrain.cli.train_rm", "reward-model training on preference pairs"),
    "dpo": ("posttrain.cli.train_dpo", "direct preference optimisation (DPO / IPO / cDPO)"),
    "kd": ("posttrain.cli.train_kd", "knowledge distillation: SFT towards a frozen teacher's tokens"),
    "kto": ("posttrain.cli.train_kto", "KTO on unpaired rows (a completion labelled desirable or not)"),
    "prm": ("posttrain.cli.train_prm", "process reward model: scores each step (step-labelled rows)"),
    "ppo": ("posttrain.cli.train_ppo_ray", "RL from a reward: PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO"),
    "lora-merge": ("posttrain.cli.lora_combiner", "merge a LoRA adapter into a standalone HF model"),
    "ds-to-hf": ("posttrain.cli.ds_to_hf", "a DeepSpeed ZeRO checkpoint (OpenRLHF's, posttrain's) as a plain "
                                           "HF folder"),
    "serve-rm": ("posttrain.cli.serve_rm", "serve a reward model or reward_func over HTTP"),
    "chat": ("posttrain.cli.chat", "talk to a model: chat template, history, /reset"),
    "generate": ("posttrain.cli.generate", "sample a dataset's prompts into JSONL, scored, best-of-n"),
    "eval": ("posttrain.cli.evaluate", "pass@k and mean reward of a model on a labelled dataset"),
    "plot": ("posttrain.cli.plot", "PNG charts of a run's metrics.jsonl"),
    "demo": ("posttrain.cli.demo", "the main job: init-tiny -> SFT -> RM / DPO / RL on a synthetic task"),
}


def usage() -> str:
    lines = ["usage: posttrain <command> [flags]   (posttrain <command> --help for its flags)",
             "       posttrain --version", "", "commands:"]
    lines += [f"  {name:<11} {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def version() -> str:
    """`posttrain <version>` (the package's `__version__`, which pyproject.toml reads too), then the versions
    of torch, transformers and Python on the next line."""
    import platform
    from importlib.metadata import version as installed

    import posttrain

    return (f"posttrain {posttrain.__version__}\ntorch {installed('torch')}, "
            f"transformers {installed('transformers')}, Python {platform.python_version()}")


def main(argv: list[str] | None = None):
    """Run `posttrain <command>`. `argv` None: the process's arguments, i.e. the console command, which
    exits after it (signals: `exits.command_line`); a list: an in-process call, which gets its signal
    handlers back however the command ends."""
    from posttrain.cli.exits import command_line

    with command_line(argv is None):
        return _main(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(version())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"posttrain: error: unknown command '{name}'{hint}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(COMMANDS[name][0])
    if name in ("sft", "rm", "dpo", "kd", "kto", "prm", "ppo"):
        module.main(rest, prog=f"posttrain {name}")
    else:
        module.main(rest)
    return 0


if __name__ == "__main__":
    main()
