"""SFT training throughput: posttrain (`posttrain.cli.train_sft.main`) vs TRL's `SFTTrainer`, same run.

    .venv/bin/python bench/sft.py [--size tiny] [--steps 30] [--repeats 3] [--no-packed]
                                  [--posttrain-flags=--ds.no_onednn_linear]

Both sides train a fresh copy of one tiny random-init model (`build_tiny`, loaded from the same
folder) on the same synthetic arithmetic rows, formatted by the tokenizer's chat template with the
loss on the completion only (posttrain: `--data.apply_chat_template` with prompt/response keys;
TRL: the conversational prompt-completion format with `completion_only_loss=True`), in the same
order (posttrain's epoch-0 permutation; TRL gets the rows pre-ordered with a sequential sampler),
with the same global batch, micro-batch / gradient accumulation, AdamW (betas 0.9/0.95, eps 1e-8,
no weight decay), clip 1.0, cosine-with-min-lr schedule and warm-up, fp32, sdpa attention, no
eval, no checkpoints, loss logged every step to the framework's minimum sink (posttrain's
metrics.jsonl; TRL with report_to="none").

Each configuration runs in its own process, and a repeat runs all of them round-robin: the processes
start together and do their set-up (imports, model load, tokenisation) and first optimizer step
concurrently, untimed; then only one trains at a time, in turns of --chunk optimizer steps, the
turn order rotating each round, while the others are parked on a pipe read (no CPU); after the last
step all are released to export and exit. So outside load on a shared machine hits every
configuration alike, and the repeats (fresh processes each) give the median. --posttrain-flags adds
the configuration `posttrain+` (posttrain's default one plus those flags) to the same round-robin.

Timing: each worker calls `TurnClock.tick()` right after each optimizer step (posttrain: wrapping
`TorchEngine.step`; TRL: a `TrainerCallback.on_step_end`). A step's time runs from the end of the
previous step (or from getting the CPU back after a hand-off) to its own end, and covers data
collation, forward, backward, clipping, optimizer, scheduler and the previous step's logging.
Step 1 (warm-up) is excluded; throughput = non-pad tokens of steps 2..N / their summed time.
Each worker also reports the CPU share other processes took during its timed steps (/proc/stat
minus its own CPU time).

Same-run checks: each side's collator is wrapped to record, per micro-batch, the non-pad token
count, the target-token count and a digest of the (input_ids, loss mask) pairs; the script checks
that all configurations saw identical micro-batches, the same learning rate every step, and prints
the largest per-step loss difference. Not a test: nothing asserts on time.
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

# name -> (framework, packed): packed = posttrain --ds.packing_samples / TRL padding_free=True
CONFIGS = {
    "posttrain": ("posttrain", False),
    PLUS: ("posttrain", False),  # only with --posttrain-flags
    "trl": ("trl", False),
    "posttrain --ds.packing_samples": ("posttrain", True),
    "trl padding_free=True": ("trl", True),
}


# ---- worker side ---------------------------------------------------------------------------------
def record(pairs) -> dict:
    """One micro-batch as the collator received it: [(input_ids, loss_mask 0/1)] per sample."""
    h = hashlib.sha1()
    tokens = targets = longest = count = 0
    for ids, mask in pairs:
        count += 1
        ids, mask = [int(x) for x in ids], [int(x) for x in mask]
        h.update(repr((ids, mask)).encode())
        tokens += len(ids)
        targets += sum(mask[1:])  # token 0 is never a target (nothing precedes it)
        longest = max(longest, len(ids))
    return {"tokens": tokens, "targets": targets, "padded": longest * count, "digest": h.hexdigest()[:16]}


def _posttrain_argv(spec: dict, packed: bool, out_dir: Path) -> list[str]:
    argv = ["--model.model_name_or_path", spec["model"], "--data.dataset", spec["data"],
            "--data.input_key", "prompt", "--data.output_key", "response", "--data.apply_chat_template",
            "--data.max_len", str(spec["max_len"]), "--eval.split", "test",  # no test split => no eval set
            "--train.batch_size", str(spec["batch_size"]),
            "--train.micro_batch_size", str(spec["micro_batch_size"]), "--train.max_epochs", "1",
            "--train.seed", str(spec["seed"]), "--adam.lr", str(spec["lr"]), "--adam.betas", "0.9", "0.95",
            "--adam.eps", "1e-8", "--adam.weight_decay", "0.0", "--max_norm", "1.0",
            "--lr_scheduler", "cosine_with_min_lr", "--lr_warmup_ratio", str(spec["warmup_ratio"]),
            "--min_lr_ratio", str(spec["min_lr_ratio"]), "--ds.param_dtype", "fp32",
            "--ds.attn_implementation", "sdpa", "--ckpt.output_dir", str(out_dir), "--ckpt.save_steps", "-1",
            "--logger.logging_steps", "1"]
    return argv + (["--ds.packing_samples"] if packed else [])


def run_posttrain(spec: dict, packed: bool, out_dir: Path, clock: TurnClock, extra: list[str]) -> dict:
    from posttrain.cli import train_sft
    from posttrain.engines.torch_engine import TorchEngine
    from posttrain.trainers import sft as sft_module

    micro, engines = [], set()
    inner_step, inner_collate = TorchEngine.step, sft_module.SFTObjective.collate

    def step(self):
        norm = inner_step(self)
        clock.tick()
        engines.add(type(self).__name__)
        return norm

    def collate(self, items):
        micro.append(record((it["input_ids"], it["loss_mask"]) for it in items))
        return inner_collate(self, items)

    TorchEngine.step, sft_module.SFTObjective.collate = step, collate
    argv = _posttrain_argv(spec, packed, out_dir) + extra
    train_sft.main(argv)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    return {"micro": micro, "losses": [r["train/loss"] for r in train],
            "lrs": [r["train/lr"] for r in train], "engine": sorted(engines),
            "argv": "python -m posttrain.cli.train_sft " + shlex.join(argv)}


def run_trl(spec: dict, packed: bool, out_dir: Path, clock: TurnClock, extra: list[str]) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(line) for line in Path(spec["data"], "train.jsonl").read_text().splitlines()]
    ordered = [rows[i] for i in spec["order"]]  # posttrain's epoch-0 order, consumed sequentially
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                  "completion": [{"role": "assistant", "content": r["response"]}]}
                                 for r in ordered])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    micro, lrs = [], []

    config = SFTConfig(
        **trl_training_args(spec, out_dir), completion_only_loss=True,
        # padding_free without packing refuses max_length (it is not enforced there); the worker checks
        # below that no sample reaches max_len, so nothing is truncated on either side
        max_length=None if packed else spec["max_len"], padding_free=packed)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                         callbacks=[trl_step_callback(clock, lrs)])
    longest = max(len(ids) for ids in trainer.train_dataset["input_ids"])
    if longest > spec["max_len"]:
        raise ValueError(f"a TRL sample has {longest} tokens > max_len {spec['max_len']}; raise --max-len")
    inner = trainer.data_collator

    def collate(examples):
        micro.append(record((e["input_ids"], [int(x != -100) for x in e["labels"]]) for e in examples))
        return inner(examples)

    trainer.data_collator = collate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"micro": micro, "losses": [h["loss"] for h in logs], "lrs": lrs,
            "trl_total_train_tokens": int(trainer._total_train_tokens), "engine": ["transformers.Trainer"]}


def worker(args) -> None:
    import torch

    spec = json.loads(Path(args.spec).read_text())
    set_threads(spec)
    framework, packed = CONFIGS[args.worker]
    steps, ga = spec["steps"], spec["batch_size"] // spec["micro_batch_size"]
    clock = TurnClock(steps, Baton(), chunk=spec["chunk"])
    res = (run_posttrain if framework == "posttrain" else run_trl)(spec, packed, Path(args.out), clock,
                                                                  side_flags(spec, args.worker))
    micro = res.pop("micro")
    if len(clock.steps) != steps or len(micro) < steps * ga:
        raise RuntimeError(f"{args.worker}: {len(clock.steps)} optimizer steps and {len(micro)} "
                           f"micro-batches, expected {steps} and {steps * ga}")
    micro = micro[: steps * ga]
    seconds, timed_steps = clock.window(skip=1)
    timed = micro[ga:]  # steps 2..N
    res.update({
        "config": args.worker, "num_threads": torch.get_num_threads(), "seconds": seconds,
        "timed_steps": timed_steps, "timed_tokens": sum(m["tokens"] for m in timed),
        "timed_targets": sum(m["targets"] for m in timed), "timed_padded": sum(m["padded"] for m in timed),
        "total_tokens": sum(m["tokens"] for m in micro), "total_targets": sum(m["targets"] for m in micro),
        "digests": [m["digest"] for m in micro], "final_loss": res["losses"][-1] if res["losses"] else None,
        "tokens_per_s": sum(m["tokens"] for m in timed) / seconds, "others_share": clock.others_share(skip=1),
        "step_seconds": [st[0] for st in clock.steps], "step_cpu_seconds": [st[1] for st in clock.steps]})
    Path(args.result).write_text(json.dumps(res))


# ---- driver side ---------------------------------------------------------------------------------
def prepare(args, work: Path) -> dict:
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny
    from posttrain.trainers.batching import epoch_order

    model = work / "base"
    if not (model / "config.json").exists():
        build_tiny(str(model), arch="llama", size=args.size, head="lm", seed=0, verbose=False, overwrite=True)
    n = args.steps * args.batch_size  # exactly one epoch of `steps` full global batches
    rows = make_arithmetic_rows(n, seed=args.seed, difficulty=args.difficulty)
    write_jsonl(rows, work / "data" / "train.jsonl")  # no test split: the posttrain run has no eval set
    return {"model": str(model), "data": str(work / "data"), "steps": args.steps,
            "batch_size": args.batch_size, "micro_batch_size": args.micro_batch_size, "max_len": args.max_len,
            "lr": args.lr, "warmup_ratio": args.warmup_ratio, "min_lr_ratio": 0.1, "seed": args.seed,
            "chunk": args.chunk, "order": [int(i) for i in epoch_order(n, args.seed, 0)],
            "posttrain_flags": posttrain_flags(args), "threads": args.threads}


def summarize(results: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for name, runs in results.items():
        out[name] = {"tokens_per_s": median(r["tokens_per_s"] for r in runs),
                     "seconds": median(r["seconds"] for r in runs),
                     "all_tps": [r["tokens_per_s"] for r in runs],
                     "others": max(r["others_share"] or 0.0 for r in runs),
                     **{k: runs[0][k] for k in ("timed_steps", "timed_tokens", "timed_targets",
                                                "timed_padded", "total_tokens", "total_targets", "final_loss",
                                                "losses", "lrs", "digests", "num_threads")}}
    return out


def checks(results: dict[str, list[dict]], summary: dict[str, dict]) -> list[str]:
    """Same-run checks printed with the table (not assertions: the reader judges)."""
    lines = []
    ref_name = next(iter(summary))
    ref = summary[ref_name]
    same_batches = all(r["digests"] == ref["digests"] for runs in results.values() for r in runs)
    lines.append(f"identical micro-batches (input_ids + loss mask, every step, every run): "
                 f"{'yes' if same_batches else 'NO'}")
    for key in ("total_tokens", "total_targets", "timed_tokens", "timed_targets"):
        vals = {s[key] for s in summary.values()}
        lines.append(f"{key}: {', '.join(str(v) for v in sorted(vals))} "
                     f"({'same on every side' if len(vals) == 1 else 'DIFFERENT'})")
    trl_counts = {r["trl_total_train_tokens"] for runs in results.values() for r in runs
                  if "trl_total_train_tokens" in r}
    if trl_counts:
        lines.append(f"TRL's own num_tokens counter: {', '.join(map(str, sorted(trl_counts)))}")
    lr_diff = max(abs(a - b) for s in summary.values() for a, b in zip(s["lrs"], ref["lrs"]))
    lines.append(f"learning rate per step: max |diff| vs {ref_name} = {lr_diff:.2e} "
                 f"(steps logged: {sorted({len(s['lrs']) for s in summary.values()})})")
    for name, s in summary.items():
        if name != ref_name:
            d = max(abs(a - b) for a, b in zip(s["losses"], ref["losses"]))
            lines.append(f"per-step train loss: max |{name} - {ref_name}| = {d:.2e}")
    return lines


def report(args, spec, results, summary, check_lines, vers, started) -> str:
    pairs = [("posttrain", "trl"), ("posttrain --ds.packing_samples", "trl padding_free=True"),
             ("posttrain --ds.packing_samples", "trl")]
    ref, base = summary.get("trl"), summary.get("posttrain") if PLUS in summary else None
    rows = []
    for name, s in summary.items():
        pad = 1 - s["timed_tokens"] / s["timed_padded"] if not CONFIGS[name][1] else 0.0
        rows.append([f"`{name}`", f"{s['tokens_per_s']:,.0f}",
                     " / ".join(f"{v:,.0f}" for v in s["all_tps"]),
                     f"{s['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-",
                     *([f"{s['tokens_per_s'] / base['tokens_per_s']:.3f}"] if base else []),
                     f"{s['seconds']:.2f}", s["timed_steps"], f"{s['timed_tokens']:,}",
                     f"{s['timed_targets']:,}", f"{pad:.1%}", f"{s['final_loss']:.4f}", f"{s['others']:.0%}"])
    table = md_table(["configuration", "tokens/s (median)", "tokens/s (each run)", "vs trl",
                      *(["vs posttrain"] if base else []), "timed s (median)",
                      "timed steps", "timed tokens", "timed target tokens", "padding", "final train loss",
                      "other CPU load (max)"], rows)
    ratios = [f"- {a} / {b}: **{summary[a]['tokens_per_s'] / summary[b]['tokens_per_s']:.2f}x**"
              for a, b in pairs if a in summary and b in summary]
    ratios += plus_lines(spec, {name: s["all_tps"] for name, s in summary.items()},
                         {name: [r["step_seconds"][1:] for r in runs] for name, runs in results.items()},
                         {name: [r["step_cpu_seconds"][1:] for r in runs] for name, runs in results.items()})
    cmd = ".venv/bin/python bench/sft.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    ga = args.batch_size // args.micro_batch_size
    setup = (f"model `build_tiny(arch='llama', size='{args.size}', seed=0)`; data `make_arithmetic_rows"
             f"({spec['steps'] * args.batch_size}, seed={args.seed}, difficulty={args.difficulty})`, chat "
             f"template, loss on the completion; global batch {args.batch_size} = micro-batch "
             f"{args.micro_batch_size} x {ga} accumulation; max_len {args.max_len}; {args.steps} optimizer "
             f"steps (1 epoch); AdamW lr {args.lr}, betas (0.9, 0.95), eps 1e-8, wd 0, clip 1.0, "
             f"cosine_with_min_lr (min 0.1x) with {math.ceil(args.steps * args.warmup_ratio)} warm-up steps; "
             f"fp32, sdpa; torch threads per worker {next(iter(summary.values()))['num_threads']}; "
             f"{args.repeats} repeats, each configuration in its own process, the processes taking turns of "
             f"{args.chunk} steps (round-robin).")
    vtext = ", ".join(f"{k} {v}" for k, v in vers.items())
    return "\n".join([
        "## SFT", "", f"Command: `{cmd}`  ", f"Date: {started:%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}  ", f"Versions: {vtext}", "", f"Setup: {setup}", "",
        "Throughput = non-pad tokens of optimizer steps 2..N / the wall seconds those steps took (model "
        "load, tokenisation and the first step excluded on both sides; time parked while another process had "
        "its turn excluded).", "",
        table, "", *ratios, "", "Checks:", *[f"- {c}" for c in check_lines], ""])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="build_tiny preset: nano, tiny, small, base")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (the first is warm-up)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (samples per optimizer step)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-ratio", type=float, default=0.1)
    p.add_argument("--difficulty", type=int, default=4, help="make_arithmetic_rows difficulty 0..4")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (median reported)")
    p.add_argument("--no-packed", action="store_true", help="skip the packed / padding-free configurations")
    add_posttrain_flags_arg(p)
    add_round_robin_args(p, list(CONFIGS))
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    check_step_args(p, args)

    import torch

    started = datetime.datetime.now(datetime.timezone.utc)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_sft_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}; torch.get_num_threads() = {torch.get_num_threads()}", flush=True)
    spec = prepare(args, work)
    (work / "spec.json").write_text(json.dumps(spec))
    names = [n for n in CONFIGS if not (args.no_packed and CONFIGS[n][1])
             and (n != PLUS or args.posttrain_flags)]
    results: dict[str, list[dict]] = {n: [] for n in names}
    script = str(Path(__file__).resolve())
    for rep in range(args.repeats):
        quiet = wait_for_quiet(args.max_wait)
        tags = [f"{name.split()[0]}{'-packed' if CONFIGS[name][1] else ''}-{rep}" for name in names]
        runs = run_round_robin([[script, "--worker", name, "--spec", str(work / "spec.json"),
                                 "--out", str(work / tag)]
                                for name, tag in zip(names, tags)], [work / f"{tag}.log" for tag in tags])
        print(f"repeat {rep + 1}/{args.repeats} (others' CPU share just before: {quiet:.0%})", flush=True)
        for name, res in zip(names, runs):
            results[name].append(res)
            print(f"  {name:<31} {res['tokens_per_s']:>7,.0f} tokens/s ({res['seconds']:.2f} s over "
                  f"{res['timed_steps']} steps; other processes' CPU share {res['others_share']:.0%}; "
                  f"final loss {res['final_loss']:.4f})", flush=True)
    summary = summarize(results)
    check_lines = checks(results, summary)
    text = report(args, spec, results, summary, check_lines, versions(), started)
    posttrain_cmd = results["posttrain"][0].get("argv")
    print("\n" + text)
    print(f"posttrain side, exact launch: {posttrain_cmd} (+ --ds.packing_samples for the packed row"
          + (f", + {shlex.join(spec['posttrain_flags'])} for {PLUS})" if args.posttrain_flags else ")"))
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
