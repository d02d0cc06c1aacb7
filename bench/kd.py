"""KD against SFT at equal steps: does a fresh student learn more from a trained teacher's token distributions
than from the labels alone?

    PYTHONPATH=. .venv/bin/python bench/kd.py [--seeds 42,1,2] [--rows 64] [--epochs 2] [--workdir DIR]

A nano model (`build_tiny`, seed 0) is SFT-ed on 360 single-digit additions (the demo's task,
`data.synthetic.make_arithmetic_rows`, difficulty 0) into the teacher. Then, per seed, two students start from
the same fresh nano model and train on the first --rows of those rows for --epochs with the same flags, batch
order and seed: one by `posttrain sft`, one by `posttrain kd` (the teacher, default --model.kd_coef 0.4,
forward KL). Printed per seed: the held-out token-mean NLL of the responses (40 rows the teacher never saw;
`eval/loss` of sft, `eval/nll` of kd: the same quantity) and the greedy accuracy on them
(`trainers.task_eval.greedy_accuracy`). Not a test: tests/trainers/test_kd.py asserts the NLL at one seed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path


def flags(model, data, out, seed: int, rows: int, epochs: int, *extra) -> list[str]:
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data),
            "--data.input_key", "prompt", "--data.output_key", "response", "--data.apply_chat_template",
            "--data.max_len", "48",
            "--data.max_samples", str(rows), "--train.batch_size", "8", "--train.micro_batch_size", "8",
            "--train.max_epochs", str(epochs), "--adam.lr", "3e-3", "--train.seed", str(seed),
            "--eval.dataset", str(data), "--eval.split", "test", "--ckpt.output_dir", str(out),
            "--logger.logging_steps", "1", *map(str, extra)]


def final_eval(run: Path, key: str) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r][-1]


def accuracy(run: Path, rows: list[dict]) -> float:
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.trainers.task_eval import greedy_accuracy

    return greedy_accuracy(load_causal_lm(str(run)), load_tokenizer(str(run)), rows)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="42,1,2")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--teacher-epochs", type=int, default=2)
    ap.add_argument("--kd-flags", default="", help="extra flags of the kd runs, e.g. '--model.kd_coef 0.8'")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    from posttrain.cli import train_kd, train_sft
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_kd_"))
    data, base = root / "data", root / "nano"
    rows = make_arithmetic_rows(400, seed=11, difficulty=0)
    write_jsonl(rows[:360], data / "train.jsonl")
    write_jsonl(rows[360:], data / "test.jsonl")
    build_tiny(base, arch="llama", size="nano", head="lm", seed=0, verbose=False, overwrite=True)
    teacher = root / "teacher"
    if not (teacher / "model.safetensors").exists():
        train_sft.main(flags(base, data, teacher, 42, 360, args.teacher_epochs))
    print(f"teacher: held-out NLL {final_eval(teacher, 'eval/loss'):.4f}, "
          f"accuracy {accuracy(teacher, rows[360:]):.3f}")
    table = []
    for seed in map(int, args.seeds.split(",")):
        sft, kd = root / f"sft_{seed}", root / f"kd_{seed}"
        shutil.rmtree(sft, ignore_errors=True)
        shutil.rmtree(kd, ignore_errors=True)
        train_sft.main(flags(base, data, sft, seed, args.rows, args.epochs))
        train_kd.main(flags(base, data, kd, seed, args.rows, args.epochs,
                            "--teacher.model_name_or_path", teacher, *args.kd_flags.split()))
        table.append((seed, final_eval(sft, "eval/loss"), final_eval(kd, "eval/nll"),
                      accuracy(sft, rows[360:]), accuracy(kd, rows[360:])))
    print("| seed | held-out NLL: sft | kd | greedy accuracy: sft | kd |\n|---|---|---|---|---|")
    for seed, ns, nk, acs, ack in table:
        print(f"| {seed} | {ns:.4f} | {nk:.4f} | {acs:.3f} | {ack:.3f} |")
    cols = list(zip(*table))[1:]
    print("| mean | " + " | ".join(f"{statistics.mean(c):.4f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
