"""`posttrain demo [--quick]` — the main job on the embedded default (tiny local model, one
process, CPU): init-tiny → synthetic arithmetic task → held-out accuracy → SFT → held-out
accuracy again, with plots. Everything is generated locally; nothing is downloaded."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DemoScale:
    size: str
    difficulty: int
    n_train: int
    n_test: int
    epochs: int
    batch_size: int
    lr: float


FULL = DemoScale(size="tiny", difficulty=1, n_train=8000, n_test=300, epochs=3, batch_size=32, lr=2e-3)
QUICK = DemoScale(size="nano", difficulty=0, n_train=1200, n_test=100, epochs=2, batch_size=16, lr=3e-3)


def _accuracy(model_dir: Path, rows: list[dict]) -> tuple[float, list[dict]]:
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.trainers.task_eval import greedy_accuracy

    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), dtype="fp32")
    return greedy_accuracy(model, tok, rows)


def split_held_out(rows: list[dict], n_test: int) -> tuple[list[dict], list[dict], bool]:
    """Test prompts never seen in training, when the task has enough distinct prompts; the easiest
    task (single-digit addition) has only 100, so there the test prompts are training facts too."""
    distinct = list(dict.fromkeys(r["prompt"] for r in rows))
    if len(distinct) < 4 * n_test:
        return rows[:-n_test], rows[-n_test:], False
    held = set(distinct[-n_test:])
    test = list({r["prompt"]: r for r in rows if r["prompt"] in held}.values())
    return [r for r in rows if r["prompt"] not in held], test, True


def sft_flags(scale: DemoScale, base: Path, data: Path, out: Path, seed: int) -> list[str]:
    """The SFT launch, written with the same flags as an OpenRLHF 0.10.2 train_sft.sh."""
    return [
        "--model.model_name_or_path", str(base), "--data.dataset", str(data),
        "--data.input_key", "prompt", "--data.output_key", "response", "--data.apply_chat_template",
        "--data.max_len", "64", "--eval.dataset", str(data), "--eval.split", "test", "--eval.steps", "50",
        "--train.batch_size", str(scale.batch_size), "--train.micro_batch_size", str(scale.batch_size),
        "--train.max_epochs", str(scale.epochs), "--train.seed", str(seed),
        "--adam.lr", str(scale.lr), "--lr_warmup_ratio", "0.05", "--adam.weight_decay", "0.0",
        "--ckpt.output_dir", str(out), "--ckpt.save_steps", "-1", "--logger.logging_steps", "5",
    ]


def main(argv: list[str] | None = None) -> dict:
    from posttrain.cli import train_sft
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny

    p = argparse.ArgumentParser(prog="posttrain demo", description=__doc__)
    p.add_argument("--output", default="runs/demo", help="folder for models, data, metrics and plots")
    p.add_argument("--quick", action="store_true", help="a smaller, faster variant (used by the tests)")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    scale = QUICK if args.quick else FULL
    out = Path(args.output)
    t0 = time.time()

    base = out / "base"
    build_tiny(str(base), arch="llama", size=scale.size, head="lm", seed=args.seed, overwrite=True)
    data = out / "data"
    train_rows, test_rows, disjoint = split_held_out(
        make_arithmetic_rows(scale.n_train + 2 * scale.n_test, seed=args.seed, difficulty=scale.difficulty),
        scale.n_test)
    write_jsonl(train_rows, data / "train.jsonl")
    write_jsonl(test_rows, data / "test.jsonl")

    acc_base, _ = _accuracy(base, test_rows)
    sft_dir = out / "sft"
    train_sft.main(sft_flags(scale, base, data, sft_dir, args.seed), prog="posttrain demo (sft)")
    acc_sft, samples = _accuracy(sft_dir, test_rows)

    summary = {"task": f"arithmetic difficulty {scale.difficulty}", "held_out_prompts": len(test_rows),
               "held_out_prompts_unseen_in_training": disjoint,
               "accuracy": {"base (random init)": acc_base, "after SFT": acc_sft},
               "seconds": round(time.time() - t0, 1), "plots": str(sft_dir / "plots")}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with (out / "samples_sft.jsonl").open("w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    print("\nheld-out accuracy on", summary["task"], f"({len(test_rows)} prompts, greedy)")
    print(f"  {'stage':<22}{'accuracy':>9}")
    for stage, acc in summary["accuracy"].items():
        print(f"  {stage:<22}{acc:>9.1%}")
    print(f"done in {summary['seconds']} s; metrics {sft_dir / 'metrics.jsonl'}; plots {sft_dir / 'plots'}")
    return summary


if __name__ == "__main__":
    main()
