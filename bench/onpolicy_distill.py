"""On-policy distillation: does a student's held-out accuracy rise when it learns from an accurate teacher's
per-token log-probs on its own samples, with no task reward?

    PYTHONPATH=. .venv/bin/python bench/onpolicy_distill.py [--seeds 42,1,2] [--steps 40] [--lr 3e-4]
        [--teacher-seed 42] [--data-seed 42] [--grpo-control] [--workdir DIR]

The task is `make demo`'s arithmetic (two-digit addition, the FULL recipe of `posttrain/cli/demo.py`):
SFT on a sloppy demonstrator leaves a model that usually appends a rounded estimate ("81, roughly 80"), so
the last number, which the grader reads, is wrong (about 10% held-out accuracy); GRPO with the verifiable
reward removes the habit (about 90%). Here:

0. the data: the demo's rows of --data-seed, 200 held-out prompts that no run trains on;
1. the teacher: the demo's SFT then GRPO at --teacher-seed (both reused from the --workdir if present);
2. per seed, the student: the demo's SFT of a base model built with that seed, in that seed's batch order
   (at the teacher's seed it is the model the teacher's GRPO started from);
3. on-policy distillation: `posttrain ppo` from the student with `--teacher.model_name_or_path` and no reward
   source at all (estimator `reinforce`, gamma 0, no KL penalty: Thinking Machines' recipe), --steps rollout
   batches of the demo's size (16 prompts x 8 samples, lr --lr);
4. with --grpo-control, GRPO from the same student for the same steps (the demo's verifiable reward).

Printed per seed: greedy held-out accuracy of the student,
the teacher, the distilled student and the control. Not a test:
tests/trainers/rl/test_rl_distill.py checks the mechanism and a small learning effect.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def sft(seed: int, data: Path, root: Path) -> Path:
    """The demo's SFT of a base model built with `seed`, trained with `--train.seed seed` (reused when
    present)."""
    from posttrain.cli import demo, train_sft
    from posttrain.models import build_tiny

    out = root / f"seed_{seed}"
    if not (out / "sft" / "model.safetensors").exists():
        build_tiny(str(out / "base"), arch="llama", size=demo.FULL.size, head="lm", seed=seed, overwrite=True)
        train_sft.main(demo.sft_flags(demo.FULL, out / "base", data, out / "sft", seed))
    return out / "sft"


def distill_flags(student: Path, teacher: Path, data: Path, out: Path, seed: int, steps: int, lr: float):
    from posttrain.cli import demo

    return demo._rl_common(student, data, out, seed, 16 * steps, lr, kl=0.0) + [
        "--teacher.model_name_or_path", str(teacher), "--algo.advantage.estimator", "reinforce",
        "--algo.advantage.gamma", "0", "--eval.steps", "-1"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="42,1,2")
    ap.add_argument("--teacher-seed", type=int, default=42)
    ap.add_argument("--data-seed", type=int, default=42)
    ap.add_argument("--steps", type=int, default=40, help="rollout batches of 16 prompts x 8 samples")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--grpo-control", action="store_true")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    from posttrain.cli import demo, train_ppo_ray

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_opd_"))
    t0 = time.time()
    test = demo.write_data(demo.FULL, root, args.data_seed)["test"]
    data = root / "data" / "sft"
    teacher = root / f"seed_{args.teacher_seed}" / "teacher_grpo"
    if not (teacher / "model.safetensors").exists():
        train_ppo_ray.main(demo.rl_flags(demo.FULL, sft(args.teacher_seed, data, root), data, teacher,
                                         args.teacher_seed))
    teacher_acc = demo._accuracy(teacher, test)[0]
    print(f"teacher: held-out accuracy {teacher_acc:.3f} ({(time.time() - t0) / 60:.1f} min)", flush=True)
    table = []
    for seed in map(int, args.seeds.split(",")):
        t = time.time()
        student = sft(seed, data, root)
        distilled = root / f"seed_{seed}" / f"opd_{args.steps}_{args.lr:g}"
        train_ppo_ray.main(distill_flags(student, teacher, data, distilled, seed, args.steps, args.lr))
        row = [seed, demo._accuracy(student, test)[0], teacher_acc, demo._accuracy(distilled, test)[0]]
        if args.grpo_control:
            control = root / f"seed_{seed}" / f"grpo_{args.steps}"
            recipe = replace(demo.FULL, rl_prompts=16 * args.steps)
            train_ppo_ray.main(demo.rl_flags(recipe, student, data, control, seed) + ["--eval.steps", "-1"])
            row.append(demo._accuracy(control, test)[0])
        table.append(row)
        print(f"seed {seed}: {row[1:]} ({(time.time() - t) / 60:.1f} min)", flush=True)
    head = ["seed", "student (SFT)", "teacher", f"on-policy distilled ({args.steps} steps)"]
    head += [f"GRPO control ({args.steps} steps)"] if args.grpo_control else []
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for row in table:
        print(f"| {row[0]} | " + " | ".join(f"{v:.3f}" for v in row[1:]) + " |")
    print("| mean | " + " | ".join(f"{statistics.mean(c):.3f}" for c in list(zip(*table))[1:]) + " |")
    print(f"total {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
