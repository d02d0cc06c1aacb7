"""DPO step time: posttrain (`posttrain.cli.train_dpo.main`) vs TRL's `DPOTrainer`, same run.

    .venv/bin/python bench/dpo.py [--size tiny] [--steps 20] [--batch-size 16] [--micro-batch-size 8]
                                  [--repeats 3] [--threads 0] [--posttrain-flags=--ds.no_onednn_linear]

Both sides train a fresh copy of one tiny random-init model (`build_tiny`, loaded from the same
folder; each side also loads its own frozen reference copy from that folder) on the same synthetic
preference pairs (`make_preference_rows`: an arithmetic prompt, the right answer chosen, a wrong one
rejected), formatted by the tokenizer's chat template with the loss on the responses (posttrain:
`--data.prompt_key prompt --data.apply_chat_template`; TRL: the conversational prompt / chosen /
rejected format, each response cut after its EOS as posttrain's pairs are, dropping the newline the
chat template renders after it), in the same order (posttrain's epoch-0 permutation; TRL gets the rows
pre-ordered with a sequential sampler), with the same global batch of pairs, micro-batch / gradient
accumulation, sigmoid DPO loss (beta 0.1) on summed response log-probs with the reference forward
every step (TRL `precompute_ref_log_probs=False`), AdamW (betas 0.9/0.95, eps 1e-8, no weight
decay), clip 1.0, cosine-with-min-lr schedule and warm-up, fp32, sdpa, no gradient checkpointing,
no eval, no checkpoints, metrics logged every step to each framework's minimum sink (posttrain's
metrics.jsonl; TRL `report_to="none"`).

Each side runs in its own process; a repeat runs both round-robin (`common.run_round_robin`): set-up
and the first optimizer step concurrently and untimed, then one side at a time in turns of --chunk
steps (the other parked on a pipe read), rotating the order. A step's time (`common.TurnClock`)
runs from the end of the previous step (or from getting the CPU back) to its own end: collation,
reference forward, policy forward/backward, clipping, optimizer, scheduler and the previous step's
logging. Step 1 is excluded; the result is seconds per optimizer step over steps 2..N, the median
over the repeats. --posttrain-flags adds the side `posttrain+` (posttrain's default configuration plus
those flags) to the same round-robin.

Same-run checks: each side's collator is wrapped to record, per micro-batch, a digest of the pairs
as (chosen ids, chosen loss mask, rejected ids, rejected loss mask); the script checks that both
sides saw identical micro-batches and the same learning rate every step, and prints the largest
per-step loss difference. Not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PLUS,
    Baton,
    TurnClock,
    add_posttrain_flags_arg,
    add_round_robin_args,
    check_step_args,
    machine,
    md_table,
    median,
    plus_lines,
    posttrain_flags,
    run_round_robin,
    set_threads,
    side_flags,
    trl_step_callback,
    trl_training_args,
    versions,
    wait_for_quiet,
)

SIDES = ("posttrain", PLUS, "trl")  # PLUS only with --posttrain-flags


# ---- worker side ---------------------------------------------------------------------------------
def record(pairs) -> dict:
    """One micro-batch as the collator received it: [(chosen ids, chosen mask, rejected
    ids, rejected mask)]."""
    h = hashlib.sha1()
    tokens = 0
    for c_ids, c_mask, r_ids, r_mask in pairs:
        sides = [[int(x) for x in v] for v in (c_ids, c_mask, r_ids, r_mask)]
        h.update(repr(sides).encode())
        tokens += len(sides[0]) + len(sides[2])
    return {"tokens": tokens, "digest": h.hexdigest()[:16]}


def _posttrain_argv(spec: dict, out_dir: Path) -> list[str]:
    return ["--model.model_name_or_path", spec["model"], "--data.dataset", spec["data"],
            "--data.prompt_key", "prompt", "--data.apply_chat_template",
            "--data.max_len", str(spec["max_len"]),
            "--eval.split", "test",  # no test split => no eval set
            "--train.batch_size", str(spec["batch_size"]),
            "--train.micro_batch_size", str(spec["micro_batch_size"]), "--train.max_epochs", "1",
            "--train.seed", str(spec["seed"]), "--model.beta", str(spec["beta"]),
            "--adam.lr", str(spec["lr"]), "--adam.betas", "0.9", "0.95", "--adam.eps", "1e-8",
            "--adam.weight_decay", "0.0", "--max_norm", "1.0", "--lr_scheduler", "cosine_with_min_lr",
            "--lr_warmup_ratio", str(spec["warmup_ratio"]), "--min_lr_ratio", str(spec["min_lr_ratio"]),
            "--ds.param_dtype", "fp32", "--ds.attn_implementation", "sdpa", "--ckpt.output_dir", str(out_dir),
            "--ckpt.save_steps", "-1", "--logger.logging_steps", "1"]


def run_posttrain(spec: dict, out_dir: Path, clock: TurnClock, extra: list[str]) -> dict:
    from posttrain.cli import train_dpo
    from posttrain.engines.torch_engine import TorchEngine
    from posttrain.trainers import dpo as dpo_module

    micro = []
    inner_step, inner_collate = TorchEngine.step, dpo_module.DPOObjective.collate

    def step(self):
        norm = inner_step(self)
        clock.tick()
        return norm

    def collate(self, items):
        micro.append(record((it["chosen_ids"], it["chosen_mask"], it["rejected_ids"], it["rejected_mask"])
                            for it in items))
        return inner_collate(self, items)

    TorchEngine.step, dpo_module.DPOObjective.collate = step, collate
    argv = _posttrain_argv(spec, out_dir) + extra
    train_dpo.main(argv)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    return {"micro": micro, "losses": [r["train/loss"] for r in train], "lrs": [r["train/lr"] for r in train],
            "argv": "python -m posttrain.cli.train_dpo " + shlex.join(argv)}


def run_trl(spec: dict, out_dir: Path, clock: TurnClock) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in Path(spec["data"], "train.jsonl").read_text().splitlines()]
    ordered = [rows[i] for i in spec["order"]]  # posttrain's epoch-0 order, consumed sequentially
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                  "chosen": [{"role": "assistant", "content": r["chosen"]}],
                                  "rejected": [{"role": "assistant", "content": r["rejected"]}]}
                                 for r in ordered])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    micro, lrs = [], []

    config = DPOConfig(
        **trl_training_args(spec, out_dir), beta=spec["beta"], loss_type=["sigmoid"],
        precompute_ref_log_probs=False, max_length=spec["max_len"])
    trainer = DPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                         callbacks=[trl_step_callback(clock, lrs)])
    eos = tok.eos_token_id

    def end_at_eos(ids: list[int]) -> list[int]:  # posttrain's pairs end at EOS, without the template's "\n"
        last = max(i for i, t in enumerate(ids) if t == eos) if eos in ids else len(ids) - 1
        return ids[: last + 1] if not tok.decode(ids[last + 1:]).strip() else ids

    trainer.train_dataset = trainer.train_dataset.map(
        lambda e: {"chosen_ids": end_at_eos(e["chosen_ids"]), "rejected_ids": end_at_eos(e["rejected_ids"])})
    longest = max(len(p) + max(len(c), len(r)) for p, c, r in zip(
        trainer.train_dataset["prompt_ids"], trainer.train_dataset["chosen_ids"],
        trainer.train_dataset["rejected_ids"]))
    if longest > spec["max_len"]:
        raise ValueError(f"a TRL pair has {longest} tokens > max_len {spec['max_len']}; raise --max-len")
    inner = trainer.data_collator

    def collate(examples):
        micro.append(record((e["prompt_ids"] + e["chosen_ids"],
                             [0] * len(e["prompt_ids"]) + [1] * len(e["chosen_ids"]),
                             e["prompt_ids"] + e["rejected_ids"],
                             [0] * len(e["prompt_ids"]) + [1] * len(e["rejected_ids"])) for e in examples))
        return inner(examples)

    trainer.data_collator = collate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"micro": micro, "losses": [h["loss"] for h in logs], "lrs": lrs}


def worker(args) -> None:
    import torch

    spec = json.loads(Path(args.spec).read_text())
    set_threads(spec)
    steps, ga = spec["steps"], spec["batch_size"] // spec["micro_batch_size"]
    clock = TurnClock(steps, Baton(), chunk=spec["chunk"])
    if args.worker == "trl":
        res = run_trl(spec, Path(args.out), clock)
    else:
        res = run_posttrain(spec, Path(args.out), clock, side_flags(spec, args.worker))
    micro = res.pop("micro")
    if len(clock.steps) != steps or len(micro) < steps * ga:
        raise RuntimeError(f"{args.worker}: {len(clock.steps)} optimizer steps and {len(micro)} "
                           f"micro-batches, expected {steps} and {steps * ga}")
    micro = micro[: steps * ga]
    seconds, timed_steps = clock.window(skip=1)
    res.update({"side": args.worker, "num_threads": torch.get_num_threads(), "seconds": seconds,
                "timed_steps": timed_steps, "s_per_step": seconds / timed_steps,
                "tokens": sum(m["tokens"] for m in micro), "digests": [m["digest"] for m in micro],
                "final_loss": res["losses"][-1] if res["losses"] else None,
                "others_share": clock.others_share(skip=1), "step_seconds": [st[0] for st in clock.steps],
                "step_cpu_seconds": [st[1] for st in clock.steps]})
    Path(args.result).write_text(json.dumps(res))


# ---- driver side ---------------------------------------------------------------------------------
def prepare(args, work: Path) -> dict:
    from posttrain.data.synthetic import make_preference_rows, write_jsonl
    from posttrain.models import build_tiny
    from posttrain.trainers.batching import epoch_order

    model = work / "base"
    if not (model / "config.json").exists():
        build_tiny(str(model), arch="llama", size=args.size, head="lm", seed=0, verbose=False, overwrite=True)
    n = args.steps * args.batch_size  # exactly one epoch of `steps` full global batches
    rows = make_preference_rows(n, seed=args.seed, difficulty=args.difficulty)
    write_jsonl([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows],
                work / "data" / "train.jsonl")
    return {"model": str(model), "data": str(work / "data"), "steps": args.steps,
            "batch_size": args.batch_size, "micro_batch_size": args.micro_batch_size, "max_len": args.max_len,
            "lr": args.lr, "beta": args.beta, "warmup_ratio": args.warmup_ratio, "min_lr_ratio": 0.1,
            "seed": args.seed, "chunk": args.chunk, "threads": args.threads,
            "order": [int(i) for i in epoch_order(n, args.seed, 0)], "posttrain_flags": posttrain_flags(args)}


def report(args, spec, results: dict[str, list[dict]], vers, started) -> str:
    summ = {side: {"s": median(r["s_per_step"] for r in runs), "all": [r["s_per_step"] for r in runs],
                   "others": max(r["others_share"] or 0.0 for r in runs), **runs[0]}
            for side, runs in results.items()}
    base = summ["posttrain"] if PLUS in summ else None
    rows = [[f"`{side}`", f"{s['s']:.3f}", " / ".join(f"{v:.3f}" for v in s["all"]),
             f"{s['s'] / summ['trl']['s']:.2f}", *([f"{s['s'] / base['s']:.3f}"] if base else []),
             s["timed_steps"], f"{s['tokens']:,}", f"{s['final_loss']:.4f}", f"{s['others']:.0%}"]
            for side, s in summ.items()]
    table = md_table(["side", "s/step (median)", "s/step (each run)", "time vs trl",
                      *(["time vs posttrain"] if base else []), "timed steps", "tokens (all steps)",
                      "final train loss", "other CPU load (max)"], rows)
    ratio = summ["trl"]["s"] / summ["posttrain"]["s"]
    per_rep = [t["s_per_step"] / p["s_per_step"] for p, t in zip(results["posttrain"], results["trl"])]
    same = all(r["digests"] == summ["posttrain"]["digests"] for runs in results.values() for r in runs)
    lr_diff = max(abs(a - b) for a, b in zip(summ["posttrain"]["lrs"], summ["trl"]["lrs"]))
    loss_diff = {side: max(abs(a - b) for a, b in zip(summ["posttrain"]["losses"], s["losses"]))
                 for side, s in summ.items() if side != "posttrain"}
    plus = plus_lines(spec, {side: [1 / v for v in s["all"]] for side, s in summ.items()},
                      {side: [r["step_seconds"][1:] for r in runs] for side, runs in results.items()},
                      {side: [r["step_cpu_seconds"][1:] for r in runs] for side, runs in results.items()})
    cmd = ".venv/bin/python bench/dpo.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    ga = args.batch_size // args.micro_batch_size
    setup = (f"model `build_tiny(arch='llama', size='{args.size}', seed=0)` (+ a frozen reference copy on "
             f"each side); data `make_preference_rows({spec['steps'] * args.batch_size}, seed={args.seed}, "
             f"difficulty={args.difficulty})`, chat template, loss on the responses; global batch "
             f"{args.batch_size} pairs = micro-batch {args.micro_batch_size} x {ga} accumulation; max_len "
             f"{args.max_len}; {args.steps} optimizer steps (1 epoch); sigmoid DPO, beta {args.beta}; AdamW "
             f"lr {args.lr}, betas (0.9, 0.95), eps 1e-8, wd 0, clip 1.0, cosine_with_min_lr (min 0.1x) with "
             f"{math.ceil(args.steps * args.warmup_ratio)} warm-up steps; fp32, sdpa; torch threads "
             f"{summ['posttrain']['num_threads']}; {args.repeats} repeats, round-robin in turns of "
             f"{args.chunk} steps.")
    return "\n".join([
        "## DPO", "", f"Command: `{cmd}`  ", f"Date: {started:%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}  ", f"Versions: {', '.join(f'{k} {v}' for k, v in vers.items())}", "",
        f"Setup: {setup}", "",
        "Time per optimizer step = wall seconds of steps 2..N / (N - 1) (model load, tokenisation and the "
        "first step excluded on both sides; time parked while the other process had its turn excluded).", "",
        table, "",
        f"- trl s/step / posttrain s/step: **{ratio:.2f}x** (each repeat: "
        f"{', '.join(f'{v:.2f}' for v in per_rep)}; > 1 = posttrain faster)", *plus,
        "", "Checks:",
        f"- identical micro-batches (chosen/rejected ids + loss masks, every step, every run): "
        f"{'yes' if same else 'NO'}", f"- learning rate per step: max |posttrain - trl| = {lr_diff:.2e}",
        *[f"- per-step train loss: max |posttrain - {side}| = {d:.2e}" for side, d in loss_diff.items()], ""])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="build_tiny preset: nano, tiny, small, base")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (the first is warm-up)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (pairs per optimizer step)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="pairs per forward/backward")
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--difficulty", type=int, default=4, help="make_preference_rows difficulty 0..4")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=3, help="runs per side (median reported)")
    add_posttrain_flags_arg(p)
    add_round_robin_args(p, list(SIDES))
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    check_step_args(p, args)

    started = datetime.datetime.now(datetime.timezone.utc)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_dpo_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}", flush=True)
    spec = prepare(args, work)
    (work / "spec.json").write_text(json.dumps(spec))
    sides = [side for side in SIDES if side != PLUS or args.posttrain_flags]
    results: dict[str, list[dict]] = {side: [] for side in sides}
    script = str(Path(__file__).resolve())
    for rep in range(args.repeats):
        quiet = wait_for_quiet(args.max_wait)
        tags = [f"{side}-{rep}" for side in sides]
        runs = run_round_robin([[script, "--worker", side, "--spec", str(work / "spec.json"),
                                 "--out", str(work / tag)]
                                for side, tag in zip(sides, tags)], [work / f"{tag}.log" for tag in tags])
        print(f"repeat {rep + 1}/{args.repeats} (others' CPU share just before: {quiet:.0%})", flush=True)
        for side, res in zip(sides, runs):
            results[side].append(res)
            print(f"  {side:<10} {res['s_per_step']:.3f} s/step ({res['seconds']:.2f} s over "
                  f"{res['timed_steps']} steps; other processes' CPU share {res['others_share']:.0%}; final "
                  f"loss {res['final_loss']:.4f})", flush=True)
    text = report(args, spec, results, versions(), started)
    print("\n" + text)
    print(f"posttrain side, exact launch: {results['posttrain'][0]['argv']}"
          + (f" (+ {shlex.join(spec['posttrain_flags'])} for {PLUS})" if args.posttrain_flags else ""))
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
