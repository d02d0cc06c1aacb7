"""One GRPO step on long rows: the actor on one rank, with ring attention over 2 ranks, and with tensor
parallelism over 2 ranks (`posttrain ppo` on a local Ray instance, the `small` preset, CPU, fp32): the RL
half of `bench/long_context.py`.

    .venv/bin/python bench/long_context_rl.py [--lengths 1024,2048,4096,8192] [--configs rl1,ring2,tp2]
        [--steps 2] [--budget-gib 16] [--timeout S] [--workdir DIR] [--markdown FILE]

Model: the same `small` preset as `bench/long_context.py` (`build_model`, positions raised to the longest L).
Prompts: for each L, rows of random lines of the tiny tokenizer's corpus cut to L - 24 tokens with the
model's tokenizer (no chat template), so that a prompt with its 16 new tokens (`--rollout.max_new_tokens
16`) is a row of about L - 8 tokens, under `--data.max_len L`. Each step: 2 prompts x 2 samples
(`--rollout.batch_size 2 --rollout.n_samples_per_prompt 2`), group-normalised advantages, no KL (so no
reference model), a reward function with spread inside each group, one actor update over the 4 rows in
micro-batches of one packed row (`--ds.packing_samples --train.micro_batch_size 1`), AdamW lr 1e-6, one
HF rollout engine in its own Ray process (`--vllm.num_engines 1`), `--steps` steps.

Configurations (each L a fresh launch):
- `rl1`: the actor on 1 rank (ZeRO-2).
- `ring2`: the actor on 2 ranks, `--ds.ring_attn_size 2` (ZeRO-2): each rank computes half of every row.
- `tp2`: the actor on 2 ranks, `--ds.tensor_parallel_size 2 --ds.zero_stage 0`.

Measured from outside (Ray's workers are descendants of the launch): every 0.2 s each process's RSS; per
process the largest. The actor ranks are the `ray::RoleWorker` processes (the only role here), the engine
the `ray::EngineWorker` one. Reported per actor rank: the peak RSS, and its growth from the shortest L
of the run (the part that grows with the row: activations, logits, masks); the engine's peak; s/step
(`timing/step_total`, median of steps 2..N) and the update's share (`timing/ppo_train`); the actor's ring
traffic (`comm/actor_cp_bytes`); each step's reward mean and the actor's gradient norm (the same rollouts
and the same gradient in every configuration: a check that they train alike). Sampling every 0.2 s can miss a
peak shorter than that. Not a test: nothing asserts.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, _bench_env, machine, md_table, median, versions  # noqa: E402
from long_context import GIB, MIB, SEED, TreeWatch, build_model, kill_tree, publish, work_folder  # noqa: E402

sys.path.insert(0, str(REPO))

NEW_TOKENS, PROMPT_SLACK = 16, 24
CONFIGS = {
    "rl1": ["--actor.num_gpus_per_node", "1", "--ds.zero_stage", "2"],
    "ring2": ["--actor.num_gpus_per_node", "2", "--ds.ring_attn_size", "2", "--ds.zero_stage", "2"],
    "tp2": ["--actor.num_gpus_per_node", "2", "--ds.tensor_parallel_size", "2", "--ds.zero_stage", "0"],
}
RANKS = {"rl1": 1, "ring2": 2, "tp2": 2}
REWARD = '''
import torch


def reward_func(queries, prompts, labels, **kwargs):
    """A deterministic reward with spread inside a group: the response's length and last character."""
    out = [float((len(q) - len(p)) % 7 + ord(q[-1]) % 3) if q else 0.0 for q, p in zip(queries, prompts)]
    return torch.tensor(out)
'''


def write_prompts(work: Path, model: Path, length: int, count: int) -> Path:
    """`count` prompts of exactly L - PROMPT_SLACK tokens of the model's tokenizer (module doc)."""
    from transformers import AutoTokenizer

    from posttrain.data.synthetic import write_jsonl
    from posttrain.models.tiny_corpus import tiny_corpus

    folder = work / "prompts" / f"L{length}"
    if not (folder / "train.jsonl").exists():
        tokenizer, lines, rng = (AutoTokenizer.from_pretrained(str(model)), tiny_corpus(),
                                 random.Random(SEED + length))
        rows = []
        for _ in range(count):
            text = []
            while len(text) < 1.2 * length:
                text += rng.choice(lines).split()
            ids = tokenizer(" ".join(text), add_special_tokens=False)["input_ids"][:length - PROMPT_SLACK]
            rows.append({"prompt": tokenizer.decode(ids)})
        write_jsonl(rows, str(folder / "train.jsonl"))
    return folder


def ppo_argv(model: Path, prompts: Path, reward: Path, out: Path, length: int, steps: int,
             extra: list[str]) -> list[str]:
    return ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(prompts),
            "--data.input_key", "prompt", "--data.max_len", str(length), "--data.max_samples", str(2 * steps),
            "--reward.remote_url", str(reward), "--rollout.batch_size", "2",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", str(NEW_TOKENS),
            "--rollout.micro_batch_size", "1", "--train.batch_size", "4", "--train.micro_batch_size", "1",
            "--train.max_epochs", "1", "--train.num_episodes", "1",
            "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--actor.adam.lr", "1e-6",
            "--actor.lr_warmup_ratio", "0", "--ds.packing_samples", "--ds.param_dtype", "fp32",
            "--ds.attn_implementation", "sdpa", "--vllm.num_engines", "1", "--ckpt.output_dir", str(out),
            "--ckpt.save_steps", "-1", "--logger.logging_steps", "1", *extra]


def run_one(args, work: Path, model: Path, reward: Path, name: str, length: int) -> dict:
    cached = work / "results" / f"{name}_L{length}.json"
    if args.reuse and cached.exists():
        return json.loads(cached.read_text())
    prompts = write_prompts(work, model, length, 2 * args.steps)
    out = work / "runs" / f"{name}_L{length}"
    argv = ppo_argv(model, prompts, reward, out, length, args.steps, CONFIGS[name])
    log = work / "logs" / f"{name}_L{length}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.train_ppo_ray", *argv], cwd=REPO,
                                env=_bench_env(), stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
        watch = TreeWatch(proc, args.budget_gib * GIB)
        with watch:
            try:
                rc = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                rc = "timeout"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    res = {"name": name, "length": length, "rc": rc, "killed": watch.killed,
           "wall": time.perf_counter() - started,
           "actor_peaks": watch.by_title("ray::RoleWorker", RANKS[name]),
           "engine_peaks": watch.by_title("ray::EngineWorker", 1),
           "metrics": [m for m in metrics if "timing/step_total" in m], "argv": argv}
    if rc != 0:
        res["error"] = "killed above the budget" if watch.killed else \
            (log.read_text().strip().splitlines() or ["no output"])[-1][:300]
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(res))
    return res


def _steady(res: dict, key: str) -> float | None:
    values = [m[key] for m in res["metrics"] if key in m]
    return median(values[1:]) if len(values) > 1 else (values[0] if values else None)


def report(args, results: list[dict], started) -> str:
    ok = [r for r in results if "error" not in r and r["actor_peaks"]]
    shortest = {n: min((r for r in ok if r["name"] == n), key=lambda r: r["length"])
                for n in {r["name"] for r in ok}}
    rows, growth = [], {}
    for r in results:
        if "error" in r:
            rows.append([f"`{r['name']}`", r["length"], "FAILED", r["error"], *[""] * 7])
            continue
        base = shortest[r["name"]]
        grow = [p - b for p, b in zip(r["actor_peaks"], base["actor_peaks"])]
        growth[(r["name"], r["length"])] = max(grow)
        cp = _steady(r, "comm/actor_cp_bytes")
        rows.append([f"`{r['name']}`", r["length"], len(r["actor_peaks"]),
                     " / ".join(f"{p / GIB:.2f}" for p in r["actor_peaks"]),
                     " / ".join(f"{g / GIB:.2f}" for g in grow),
                     f"{max(r['engine_peaks'], default=0) / GIB:.2f}",
                     f"{_steady(r, 'timing/step_total'):.1f}", f"{_steady(r, 'timing/ppo_train'):.1f}",
                     "-" if cp is None else f"{cp / MIB:,.0f}",
                     " / ".join(f"{m.get('reward/mean', 0):.3f}" for m in r["metrics"]),
                     " / ".join(f"{m.get('actor/grad_norm', 0):.4f}" for m in r["metrics"])])
    lines = ["## Long rows in RL: one GRPO step (`bench/long_context_rl.py`)", "",
             f"- command: `.venv/bin/python bench/long_context_rl.py --lengths "
             f"{','.join(map(str, args.lengths))} --configs {','.join(args.configs)} --steps {args.steps} "
             f"--budget-gib {args.budget_gib:g}`", f"- date: {started:%Y-%m-%d %H:%M} UTC",
             f"- machine: {machine()}", "- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()),
             "",
             md_table(["config", "L", "actor ranks", "actor peak GiB",
                       f"growth from L={min(args.lengths)} GiB", "engine peak GiB", "s/step", "update s",
                       "actor cp MiB/step", "reward mean per step", "actor grad norm per step"], rows), ""]
    for length in args.lengths:
        one = growth.get(("rl1", length))
        for name in ("ring2", "tp2"):
            mine = growth.get((name, length))
            if one and mine is not None and length != min(args.lengths):
                lines.append(f"- {name} / rl1, growth of the actor rank's peak from L={min(args.lengths):,} "
                             f"to L={length:,}: **{mine / one:.2f}x**")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192", help="row lengths in tokens, comma-separated")
    ap.add_argument("--configs", default="rl1,ring2,tp2", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=2, help="GRPO steps per launch (step 1 is not timed)")
    ap.add_argument("--budget-gib", type=float, default=16.0, help="memory for a launch (all its processes)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    ap.add_argument("--workdir", help="model, prompts, runs, results (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true", help="reuse WORKDIR/results/<config>_L<L>.json when "
                                                         "present")
    ap.add_argument("--markdown", help="also write the markdown section to this file")
    args = ap.parse_args(argv)
    args.lengths = sorted(int(x) for x in args.lengths.split(",") if x.strip())
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.configs:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown {c!r}; valid: {', '.join(CONFIGS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    with work_folder(args.workdir, "bench_long_rl_") as work:
        model = build_model(work, max(args.lengths))
        reward = work / "reward.py"
        reward.write_text(REWARD)
        results = []
        for length in args.lengths:
            for name in args.configs:
                res = run_one(args, work, model, reward, name, length)
                results.append(res)
                peaks = " / ".join(f"{p / GIB:.2f}" for p in res["actor_peaks"])
                print(f"[{time.strftime('%H:%M:%S')}] {name} L={length}: actor peak {peaks} GiB, "
                      f"{res.get('error') or 'ok'} ({res['wall']:.0f} s)", flush=True)
        publish(report(args, results, started), args.markdown)


if __name__ == "__main__":
    main()
