"""`posttrain demo [--quick]` — the main job on the embedded default (tiny local model, one
process, CPU): init-tiny → synthetic arithmetic task → SFT → RL with a verifiable reward (GRPO),
printing held-out accuracy after each stage, with plots. Everything is generated locally."""
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
    rl_prompts: int
    rl_lr: float


FULL = DemoScale(size="tiny", difficulty=1, n_train=8000, n_test=300, epochs=3, batch_size=32, lr=2e-3,
                 rl_prompts=3200, rl_lr=1e-4)
QUICK = DemoScale(size="nano", difficulty=0, n_train=1200, n_test=100, epochs=2, batch_size=16, lr=3e-3,
                  rl_prompts=80, rl_lr=1e-4)


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


def rl_flags(scale: DemoScale, sft: Path, data: Path, out: Path, seed: int) -> list[str]:
    """GRPO with the shipped verifiable reward (OpenRLHF train_ppo_ray flags)."""
    from posttrain.agents.rewards.examples import ARITHMETIC

    return [
        "--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
        "--data.label_key", "answer", "--data.apply_chat_template", "--data.max_len", "64",
        "--data.max_samples", str(scale.rl_prompts), "--reward.remote_url", ARITHMETIC,
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "8", "--rollout.max_new_tokens", "6",
        "--rollout.micro_batch_size", "64", "--train.batch_size", "128", "--train.micro_batch_size", "64",
        "--actor.adam.lr", str(scale.rl_lr), "--actor.lr_warmup_ratio", "0.05", "--train.seed", str(seed),
        "--eval.dataset", str(data), "--eval.split", "test", "--eval.steps", "50", "--eval.temperature", "0",
        "--eval.n_samples_per_prompt", "1", "--ckpt.output_dir", str(out), "--logger.logging_steps", "1",
    ]


def main(argv: list[str] | None = None) -> dict:
    from posttrain.cli import train_ppo_ray, train_sft
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
    acc_sft, _ = _accuracy(sft_dir, test_rows)
    t_sft = time.time()
    rl_dir = out / "rl"
    train_ppo_ray.main(rl_flags(scale, sft_dir, data, rl_dir, args.seed), prog="posttrain demo (rl)")
    acc_rl, samples = _accuracy(rl_dir, test_rows)

    summary = {"task": f"arithmetic difficulty {scale.difficulty}", "held_out_prompts": len(test_rows),
               "held_out_prompts_unseen_in_training": disjoint,
               "accuracy": {"base (random init)": acc_base, "after SFT": acc_sft, "after RL (GRPO)": acc_rl},
               "seconds": round(time.time() - t0, 1), "seconds_rl": round(time.time() - t_sft, 1),
               "plots": [str(sft_dir / "plots"), str(rl_dir / "plots")]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with (out / "samples_final.jsonl").open("w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    print("\nheld-out accuracy on", summary["task"], f"({len(test_rows)} prompts, greedy)")
    print(f"  {'stage':<22}{'accuracy':>9}")
    for stage, acc in summary["accuracy"].items():
        print(f"  {stage:<22}{acc:>9.1%}")
    print(f"done in {summary['seconds']} s; metrics and plots in {sft_dir} and {rl_dir} "
          f"(reward curve: {rl_dir / 'plots' / 'reward.png'})")
    return summary


if __name__ == "__main__":
    main()
