"""RL step time: `posttrain ppo` (group_norm, i.e. GRPO) vs TRL's `GRPOTrainer`, same run.

    .venv/bin/python bench/rl_step.py [--prompts 16] [--n 8] [--max-new-tokens 8] [--micro-batch-size 32]
                                      [--steps 8] [--warmup 2] [--repeats 2] [--threads 1] [--profile]

Both sides train a fresh copy of one tiny random-init model (`build_tiny(dir, "llama", size)`, fp32,
sdpa, loaded from the same folder) on the same synthetic arithmetic prompts, rendered by the
tokenizer's chat template with the generation prompt (posttrain: `--data.apply_chat_template`;
TRL: the conversational prompt format), in the same order (posttrain's prompt stream; TRL gets the
rows pre-ordered and `shuffle_dataset=False`). One step = one rollout of `prompts` prompts x `n`
samples (temperature 1, top_p 1, top_k off, `max_new_tokens` tokens, stop at the tokenizer's eos),
scored by the same verifiable arithmetic reward (posttrain: the shipped
`posttrain/rewards/examples/arithmetic_reward.py`; TRL: a Python function with the same
`is_correct` check), group-normalised advantages (`(r - mean) / std` per group, unbiased std on
both sides), then exactly one optimizer step over all samples (posttrain `--train.batch_size` =
prompts x n, `--train.max_epochs 1`; TRL `per_device_train_batch_size` x
`gradient_accumulation_steps` = prompts x n = its generation batch, `num_iterations=1`), in
micro-batches of `--micro-batch-size`. The loss is the clipped surrogate (eps 0.2) averaged over
every completion token of the optimizer step: posttrain `--actor.loss_agg token_mean` (global token
count of the step) and TRL `loss_type="dapo"` (divides by the active tokens of the whole accumulated
batch) — the same aggregation. No KL and no reference model (`--algo.kl.init_coef 0` / `beta=0`),
AdamW (betas 0.9/0.95, eps 1e-8, no weight decay), clip 1.0, cosine-with-min-lr schedule (ratio 0.1)
without warm-up, no eval, no checkpoints, metrics to each framework's minimum sink (posttrain's
metrics.jsonl; TRL `report_to="none"`, `logging_steps=1`), TRL without vLLM.

Every (side, repeat) runs in its own subprocess, interleaved (repeat r+1 runs the sides in reverse
order). Stamps (`common.StepClock`: wall, own CPU, machine busy CPU) are taken at the end of every
step (posttrain: after `RLTrainer.step` returns; TRL: `on_step_end`); a step's time is the gap
between consecutive stamps, so it holds the whole loop iteration (generation, reward, experience,
update, logging). The first `--warmup` steps are left out; the median of the others is reported,
then the median over repeats. Before each run the driver waits for the machine to go quiet; a run
during which other processes used more than `--max-others` of the CPU is rerun (`--retries`; the
quietest attempt is kept). The workers run torch with `--threads 1` by default: on a shared 2-core
machine a 2-thread step is dominated by scheduling (seen: 3-35 s per step instead of 0.86 s),
while one thread's wall time stays ~ its own CPU time; `--threads 0` (torch's default, one thread
per core) is the number to quote on a quiet machine. The script checks
that both sides saw the same prompt token ids every step and reports the generated token counts.
Breakdown: posttrain's own `timing/*` metrics; TRL's phases by wrapping `_generate_single_turn`
(generation) and `_generate_and_score_completions` (generation + reward + advantages) — the rest
of its step is the training forward/backward, optimizer and logging. `--profile` adds a cProfile
of one timed posttrain step. Not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import hashlib
import io
import json
import pstats
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    REPO,
    StepClock,
    add_posttrain_flags_arg,
    add_rl_step_args,
    machine,
    md_table,
    median,
    plus_lines,
    posttrain_flags,
    run_worker,
    side_flags,
    trl_grpo_args,
    versions,
    wait_for_quiet,
)

REWARD_FILE = REPO / "posttrain" / "rewards" / "examples" / "arithmetic_reward.py"
SEED = 42


def _digest(prompt_ids) -> str:
    return hashlib.sha1(repr([list(map(int, p)) for p in prompt_ids]).encode()).hexdigest()[:16]


# ---- worker side ---------------------------------------------------------------------------------
def _posttrain_argv(spec: dict, out_dir: Path) -> list[str]:
    total = spec["prompts"] * spec["n"]
    return ["--actor.model_name_or_path", spec["model"], "--data.prompt_dataset", spec["data"],
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--reward.remote_url", str(REWARD_FILE), "--algo.advantage.estimator", "group_norm",
            "--rollout.batch_size", str(spec["prompts"]), "--rollout.n_samples_per_prompt", str(spec["n"]),
            "--rollout.max_new_tokens", str(spec["max_new_tokens"]), "--rollout.temperature", "1.0",
            "--rollout.top_p", "1.0", "--rollout.micro_batch_size", str(spec["micro_batch_size"]),
            "--train.batch_size", str(total), "--train.micro_batch_size", str(spec["micro_batch_size"]),
            "--train.max_epochs", "1", "--train.num_episodes", "1", "--train.seed", str(SEED),
            "--actor.loss_agg", "token_mean", "--actor.eps_clip", "0.2", "--algo.kl.init_coef", "0",
            "--actor.adam.lr", str(spec["lr"]), "--actor.adam.betas", "0.9", "0.95",
            "--actor.adam.eps", "1e-8", "--actor.adam.weight_decay", "0.0", "--actor.max_norm", "1.0",
            "--actor.lr_scheduler", "cosine_with_min_lr", "--actor.lr_warmup_ratio", "0",
            "--actor.min_lr_ratio", "0.1", "--ds.param_dtype", "fp32", "--ds.attn_implementation", "sdpa",
            "--ckpt.output_dir", str(out_dir), "--ckpt.path", str(out_dir / "checkpoints"),
            "--ckpt.save_steps", "-1", "--logger.logging_steps", "1"]


def run_posttrain(spec: dict, out_dir: Path, profile_step: int | None, extra: list[str] = (),
                  clock=None) -> dict:
    """`clock` (default a fresh `StepClock`) is ticked after every step; bench/moe.py passes a `TurnClock`."""
    from posttrain.cli import train_ppo_ray
    from posttrain.rollout import HFRolloutEngine
    from posttrain.trainers.rl import ppo as ppo_module

    clock, prompts, gen_tokens, prof_text = clock or StepClock(), [], [], []
    inner_step, inner_sequences = ppo_module.RLTrainer.step, HFRolloutEngine.sequences
    drawn = []  # the decode sequences of the current step (every generation path builds them here)

    def step(self):
        if profile_step is not None and len(clock.stamps) == profile_step:
            prof = cProfile.Profile()
            prof.enable()
            out = inner_step(self)
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
            prof_text.append(s.getvalue())
        else:
            out = inner_step(self)
        clock.tick()
        prompts.append(_digest([seq.prompt for seq in drawn]))  # one row per sample, group-contiguous
        gen_tokens.append(sum(len(seq.output().output_token_ids) for seq in drawn))
        drawn.clear()
        return out

    def sequences(self, *args, **kwargs):
        out = inner_sequences(self, *args, **kwargs)
        drawn.extend(out)
        return out

    ppo_module.RLTrainer.step, HFRolloutEngine.sequences = step, sequences
    argv = _posttrain_argv(spec, out_dir) + list(extra)
    train_ppo_ray.main(argv)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {k: [r[k] for r in rows if k in r] for k in
              ("timing/step_total", "timing/generation", "timing/make_experience", "timing/ppo_train")}
    return {"clock": clock, "prompt_digests": prompts, "gen_tokens": gen_tokens, "phases": phases,
            "reward_mean": [r.get("reward/mean") for r in rows],
            "profile": prof_text[0] if prof_text else None,
            "argv": "python -m posttrain.cli.train_ppo_ray " + shlex.join(argv)}


def run_trl(spec: dict, out_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.data.synthetic import is_correct

    rows = [json.loads(line) for line in Path(spec["data"], "train.jsonl").read_text().splitlines()]
    ordered = [rows[i] for i in spec["order"]]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in ordered])

    def arithmetic_reward(completions, answer, **kwargs):
        return [1.0 if is_correct(c[0]["content"] if isinstance(c, list) else c, str(a)) else 0.0
                for c, a in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa")
    clock, prompts, gen_tokens = StepClock(), [], []
    phases = {"generate": [], "generate_and_score": []}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock.tick()

    config = GRPOConfig(**trl_grpo_args(spec, out_dir, beta=0.0, seed=SEED),
                        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1})
    trainer = GRPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tok,
                          reward_funcs=[arithmetic_reward], callbacks=[Clock()])
    inner_gen, inner_gas = trainer._generate_single_turn, trainer._generate_and_score_completions

    def generate_single_turn(prompt_ids, *a, **kw):
        t0 = time.perf_counter()
        completion_ids, logprobs = inner_gen(prompt_ids, *a, **kw)
        phases["generate"].append(time.perf_counter() - t0)
        prompts.append(_digest(prompt_ids))
        gen_tokens.append(sum(len(c) for c in completion_ids))
        return completion_ids, logprobs

    def generate_and_score(inputs):
        t0 = time.perf_counter()
        out = inner_gas(inputs)
        phases["generate_and_score"].append(time.perf_counter() - t0)
        return out

    trainer._generate_single_turn, trainer._generate_and_score_completions = (generate_single_turn,
                                                                             generate_and_score)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"clock": clock, "prompt_digests": prompts, "gen_tokens": gen_tokens, "phases": phases,
            "reward_mean": [h.get("reward") for h in logs]}


def worker(args) -> None:
    import torch

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = json.loads(Path(args.spec).read_text())
    out_dir = Path(args.out)
    if args.worker in ("posttrain", "posttrain+"):
        res = run_posttrain(spec, out_dir, spec["warmup"] if args.profile else None,
                            side_flags(spec, args.worker))
    else:
        res = run_trl(spec, out_dir)
    clock = res.pop("clock")
    if len(clock.stamps) != spec["steps"]:
        raise RuntimeError(f"{args.worker}: {len(clock.stamps)} steps, expected {spec['steps']}")
    w = spec["warmup"]
    diff = lambda xs: [b - a for a, b in zip(xs, xs[1:])]  # noqa: E731  (entry i = step i+2)
    wall, cpu = diff(clock.stamps)[w - 1:], diff(clock.own_cpu)[w - 1:]
    res.update({"side": args.worker, "num_threads": torch.get_num_threads(), "step_seconds": wall,
                "step_cpu_seconds": cpu, "median_step": median(wall), "median_cpu": median(cpu),
                "first_step_seconds": clock.stamps[0] - t_start, "others_share": clock.others_share(w)})
    Path(args.result).write_text(json.dumps(res))


# ---- driver side ---------------------------------------------------------------------------------
FILLER = "Read the question below carefully and answer with one integer. "


def pad_prompts(rows: list[dict], model: str, tokens: int) -> None:
    """Prefix each prompt with a filler sentence until its chat-rendered form (what both sides feed
    the model) has at least `tokens` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)

    def length(text: str) -> int:
        return len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))

    for r in rows:
        while length(r["prompt"]) < tokens:
            r["prompt"] = FILLER + r["prompt"]


def prepare(args, work: Path) -> dict:
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny
    from posttrain.trainers.rl.collect import PromptStream

    model = work / "base"
    info = build_tiny(str(model), arch="llama", size=args.size, head="lm", seed=0, verbose=False,
                      overwrite=True)
    n_prompts = args.steps * args.prompts  # exactly `steps` rollout batches in one episode
    rows = make_arithmetic_rows(n_prompts, seed=0)
    if args.prompt_len:
        pad_prompts(rows, str(model), args.prompt_len)
    write_jsonl(rows, str(work / "data" / "train.jsonl"))
    order = PromptStream(n_prompts, SEED).take(n_prompts)  # posttrain's prompt order, episode 0
    return {"model": str(model), "data": str(work / "data"), "prompts": args.prompts, "n": args.n,
            "max_new_tokens": args.max_new_tokens, "steps": args.steps, "warmup": args.warmup,
            "micro_batch_size": args.micro_batch_size, "lr": args.lr, "order": order,
            "num_parameters": info["num_parameters"], "vocab_size": info["vocab_size"],
            "posttrain_flags": posttrain_flags(args)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rl_step_args(ap, size="tiny", max_new_tokens=8, steps=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads in the workers (0: torch's default, the core count). 1 by "
                         "default: on a shared machine a multi-threaded step is dominated by scheduling, one "
                         "thread's wall time stays ~ its CPU time")
    ap.add_argument("--max-others", type=float, default=None,
                    help="a run during whose timed steps other processes used more than this CPU share is "
                         "rerun (default: the share of cores the workers leave free + 0.1)")
    ap.add_argument("--retries", type=int, default=1, help="reruns allowed per run (the last one is kept)")
    ap.add_argument("--max-wait", type=float, default=20.0,
                    help="seconds to wait before each run for the other processes to go idle")
    ap.add_argument("--profile", action="store_true", help="cProfile the first timed posttrain step (repeat "
                                                           "0)")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="pad every prompt with filler text to at least this many chat-rendered tokens (0: "
                         "as is)")
    ap.add_argument("--work-dir", help="keep the model, data, runs and logs here (default: a temp dir)")
    add_posttrain_flags_arg(ap)
    ap.add_argument("--no-trl", action="store_true", help="leave TRL out (compare posttrain variants only)")
    # worker mode (internal)
    ap.add_argument("--worker", choices=["posttrain", "posttrain+", "trl"])
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--result")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.warmup < 1 or args.steps < args.warmup + 2:
        raise SystemExit("need --warmup >= 1 and --steps >= --warmup + 2")
    if args.max_others is None:
        import os

        import torch

        cores = os.cpu_count() or 1
        args.max_others = max(0.0, 1 - (args.threads or torch.get_num_threads()) / cores) + 0.1
    if (args.prompts * args.n) % args.micro_batch_size:
        raise SystemExit(f"--prompts x --n = {args.prompts * args.n} must be a multiple of "
                         f"--micro-batch-size")

    started = time.perf_counter()
    tmp = None if args.work_dir else tempfile.TemporaryDirectory()
    work = Path(args.work_dir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    spec = prepare(args, work)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    names = (["posttrain"] + (["posttrain+"] if args.posttrain_flags else [])
             + ([] if args.no_trl else ["trl"]))
    results: dict[str, list[dict]] = {name: [] for name in names}
    discarded: list[str] = []
    for r in range(args.repeats):
        sides = names if r % 2 == 0 else names[::-1]
        for side in sides:
            extra = ["--profile"] if (args.profile and side == "posttrain" and r == 0) else []
            attempts = []
            for attempt in range(args.retries + 1):
                quiet = wait_for_quiet(args.max_wait, threshold=args.max_others)
                tag = f"{side}_{r}_{attempt}"
                res = run_worker(Path(__file__).resolve(), ["--worker", side, "--spec", str(spec_path),
                                                            "--threads", str(args.threads),
                                                            "--out", str(work / tag), *extra],
                                 work / f"{tag}.log")
                others = res["others_share"]
                steps = ", ".join(f"{x:.2f}" for x in res["step_seconds"])
                print(f"[{datetime.datetime.now():%H:%M:%S}] {side} repeat {r}: median step "
                      f"{res['median_step']:.3f} s wall, {res['median_cpu']:.3f} s CPU (steps {steps}); "
                      f"first step (+ set-up) {res['first_step_seconds']:.1f} s; process "
                      f"{res['process_seconds']:.0f} s; other processes' CPU share {others:.0%} (before: "
                      f"{quiet:.0%})", flush=True)
                attempts.append(res)
                if others <= args.max_others:
                    break
                if attempt < args.retries:
                    print("    (other processes were busy during the timed steps; rerunning)", flush=True)
            best = min(attempts, key=lambda x: x["others_share"])  # the quietest attempt is kept
            results[side].append(best)
            discarded += [f"{side}: {x['median_step']:.3f} s/step with {x['others_share']:.0%} other CPU load"
                          for x in attempts if x is not best]
    print(report(args, spec, results, discarded, started))
    if tmp is not None:
        tmp.cleanup()


def report(args, spec, results, discarded, started) -> str:
    ours, trl = results["posttrain"], results.get("trl")
    med = {k: median(r["median_step"] for r in v) for k, v in results.items()}
    cpu = {k: median(r["median_cpu"] for r in v) for k, v in results.items()}
    lines = ["", "## RL step time: posttrain ppo (group_norm) "
                 "vs " + ", ".join(k for k in results if k != "posttrain"),
             ""]
    lines.append(f"- machine: {machine()}; workers: " +
                 ", ".join(f"{k} {v[0]['num_threads']} threads" for k, v in results.items()))
    lines += plus_lines(spec, {k: [1 / r["median_step"] for r in v] for k, v in results.items()},
                        {k: [r["step_seconds"] for r in v] for k, v in results.items()},
                        {k: [r["step_cpu_seconds"] for r in v] for k, v in results.items()})
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    lines.append(f"- setup: llama {args.size} ({spec['num_parameters']:,} params, vocab "
                 f"{spec['vocab_size']}), {args.prompts} prompts x {args.n} samples = "
                 f"{args.prompts * args.n} per step, "
                 + (f"prompts padded to >= {args.prompt_len} tokens, " if args.prompt_len else "")
                 + f"max_new_tokens {args.max_new_tokens}, micro-batch {args.micro_batch_size}, one "
                   f"optimizer step "
                 f"per rollout, {args.steps} steps per run ({args.warmup} warm-up), {args.repeats} repeats; "
                 f"TRL loss_type='dapo' (= posttrain token_mean over the optimizer step), beta=0, no vLLM")
    lines.append(f"- command: `.venv/bin/python bench/rl_step.py {shlex.join(argv_of(args))}`")
    lines.append("")
    rows = []
    for side, runs in results.items():
        rows.append([side, f"{med[side]:.3f}", " / ".join(f"{r['median_step']:.3f}" for r in runs),
                     f"{cpu[side]:.3f}", " ".join(f"{x:.2f}" for x in runs[0]["step_seconds"]),
                     f"{median(r['first_step_seconds'] for r in runs):.1f}",
                     " / ".join(f"{r['others_share']:.0%}" for r in runs)])
    lines.append(md_table(["side", "median s/step (wall)", "each repeat", "median CPU s/step (process)",
                           "timed steps, repeat 0 (s)", "set-up + step 1 (s)", "other processes' CPU share"],
                          rows))
    lines.append("")
    if trl:
        lines.append(f"**posttrain / TRL step time = {med['posttrain'] / med['trl']:.2f}x wall, "
                     f"{cpu['posttrain'] / cpu['trl']:.2f}x CPU** (< 1: posttrain faster)")
    if "posttrain+" in results:
        lines.append(f"**posttrain+ / posttrain step time = {med['posttrain+'] / med['posttrain']:.2f}x "
                     f"wall, {cpu['posttrain+'] / cpu['posttrain']:.2f}x CPU** (< 1: the extra flags are "
                     f"faster)")
    lines.append("")
    w = args.warmup
    b = {k: median(x for r in ours for x in r["phases"][k][w:]) for k in ours[0]["phases"]
         if ours[0]["phases"][k]}
    lines.append("- posttrain breakdown (median over timed steps, metrics.jsonl): " +
                 ", ".join(f"`{k}` {v:.3f} s" for k, v in b.items()))
    if "posttrain+" in results:
        plus = results["posttrain+"]
        b = {k: median(x for r in plus for x in r["phases"][k][w:]) for k in plus[0]["phases"]
             if plus[0]["phases"][k]}
        lines.append("- posttrain+ breakdown: " + ", ".join(f"`{k}` {v:.3f} s" for k, v in b.items()))
    if trl:
        g = median(x for r in trl for x in r["phases"]["generate"][w:])
        gs = median(x for r in trl for x in r["phases"]["generate_and_score"][w:])
        lines.append(f"- TRL breakdown (median over timed steps): generate {g:.3f} s, generate + reward + "
                     f"advantages {gs:.3f} s, rest of the step (training forward/backward, optimizer, "
                     f"logging) ~{med['trl'] - gs:.3f} s")
    same_prompts = all(r["prompt_digests"] == ours[0]["prompt_digests"] for v in results.values() for r in v)
    lines.append(f"- identical prompt token ids (one row per sample) every step, both sides, every run: "
                 f"{'yes' if same_prompts else 'NO'}")
    lines.append("- generated tokens per step (repeat 0): " +
                 ", ".join(f"{k} {v[0]['gen_tokens']}" for k, v in results.items()))
    lines.append("- mean reward per step (repeat 0): " + ", ".join(
        f"{k} {[round(x, 3) for x in v[0]['reward_mean'] if x is not None]}" for k, v in results.items()))
    if discarded:
        lines.append(f"- runs discarded (other processes used > {args.max_others:.0%} of the CPU; the "
                     f"quietest attempt is kept): "
                     + "; ".join(discarded))
    lines.append(f"- posttrain launch: `{ours[0]['argv']}`")
    lines.append(f"- total wall time {time.perf_counter() - started:.0f} s")
    if ours[0].get("profile"):
        lines += ["", "cProfile of one timed posttrain step (cumulative):", "```", ours[0]["profile"], "```"]
    return "\n".join(lines)


def argv_of(args) -> list[str]:
    out = []
    for k in ("size", "prompts", "n", "max_new_tokens", "micro_batch_size", "steps", "warmup", "repeats",
              "lr", "threads", "max_others", "retries", "max_wait", "prompt_len"):
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if args.posttrain_flags:
        out += [f"--posttrain-flags={args.posttrain_flags}"]
    return out + (["--profile"] if args.profile else []) + (["--no-trl"] if args.no_trl else [])


if __name__ == "__main__":
    main()
