"""Async RL (`--train.async_enable`) against the synchronous trainer when scoring has latency that is
not compute (a sandbox, a judge model, a tool), on the same model, prompts and seed.

    .venv/bin/python bench/rl_async.py [--size small] [--prompts 16] [--n 8] [--max-new-tokens 32]
                                       [--steps 8] [--warmup 2] [--delay auto] [--queue 1] [--threads 0]

The reward (`digit_reward`: 1 for the right arithmetic answer, else the share of digits in the
response, a signal a random-init model can climb) is served over HTTP from this driver (127.0.0.1,
OpenRLHF's remote-RM request shape), answering each batch after a fixed `--delay` seconds (auto: the
training time T measured by the first run). The policy has one rank and the rollout engine is its own copy of
the policy in the same process (async), or the policy's own module (sync); both share the machine's
cores. Runs, each in its own subprocess, after a warm-up of `--warmup` steps (not timed):
  1. sync, no delay: G (generation + scoring compute, `timing/generation`) and T (the rest of the step);
  2. sync, delay D;   3. async, delay D;   4. async, no delay.
A step's time is the median of `timing/step_total` (wall clock, the wait for the batch included) over
the timed steps. The bound for async with delay is max(G + T: generation and training compute
sharing the cores, G + D: the producer's own loop, T: the trainer's own loop), well under the sync
sum G + D + T. The reward curves of runs 2 and 3 go to one PNG. Not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, md_table, median, versions  # noqa: E402

SEED = 42


def digit_reward(response: str, label: str) -> float:
    """1 for the right answer, else the share of the response's characters that are digits: a signal a
    random-init model can climb (the arithmetic check alone stays at 0 for it)."""
    from posttrain.data.synthetic import is_correct

    if is_correct(response, label):
        return 1.0
    return sum(c.isdigit() for c in response) / max(len(response), 1)


class DelayedReward:
    """An HTTP reward server on 127.0.0.1: `digit_reward`, answered after `delay` seconds."""

    def __init__(self) -> None:
        self.delay = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(outer.delay)
                rewards = [digit_reward(q[len(p):], str(label))
                           for q, p, label in zip(body["query"], body["prompts"], body["labels"])]
                data = json.dumps({"rewards": rewards, "scores": rewards}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/get_reward"


def prepare(args, work: Path) -> dict:
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny

    model = work / "base"
    info = build_tiny(str(model), arch="llama", size=args.size, head="lm", seed=0, verbose=False,
                      overwrite=True)
    write_jsonl(make_arithmetic_rows(args.steps * args.prompts, seed=0), str(work / "data" / "train.jsonl"))
    return {"model": str(model), "data": str(work / "data"), "num_parameters": info["num_parameters"]}


def flags(args, spec: dict, url: str, out: Path, async_run: bool) -> list[str]:
    total = args.prompts * args.n
    argv = ["--actor.model_name_or_path", spec["model"], "--data.prompt_dataset", spec["data"],
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--reward.remote_url", url, "--reward.timeout", "600", "--algo.advantage.estimator", "group_norm",
            "--rollout.batch_size", str(args.prompts), "--rollout.n_samples_per_prompt", str(args.n),
            "--rollout.max_new_tokens", str(args.max_new_tokens), "--rollout.micro_batch_size", "32",
            "--train.batch_size", str(total), "--train.micro_batch_size", "32", "--train.max_epochs", "1",
            "--train.num_episodes", "1", "--train.seed", str(SEED), "--algo.kl.init_coef", "0",
            "--actor.adam.lr", "3e-4", "--actor.lr_warmup_ratio", "0", "--ds.param_dtype", "fp32",
            "--ckpt.output_dir", str(out), "--logger.logging_steps", "1"]
    if async_run:
        argv += ["--train.async_enable", "--train.async_queue_size", str(args.queue)]
    return argv


def run(args, spec: dict, server: DelayedReward, work: Path, name: str, delay: float,
        async_run: bool) -> dict:
    import subprocess

    server.delay = delay
    out = work / name
    code = ("import sys, torch; t = int(sys.argv[1]); t and torch.set_num_threads(t); "
            "from posttrain.cli import train_ppo_ray; train_ppo_ray.main(sys.argv[2:])")
    cmd = [sys.executable, "-c", code, str(args.threads), *flags(args, spec, server.url, out, async_run)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step_total" in r]
    timed = rows[args.warmup:]
    step = median([r["timing/step_total"] for r in timed])
    gen = median([r["timing/generation"] for r in timed])
    return {"name": name, "delay": delay, "step": step, "generation": gen, "train": median(
        [r["timing/step_total"] - r["timing/generation"] for r in timed]),
        "staleness": max(r.get("async/staleness_max", 0.0) for r in rows),
        "rewards": [r["reward/mean"] for r in rows]}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], marker="o", label=r["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--delay", default="auto", help="seconds per reward batch, or auto (= T of run 1)")
    p.add_argument("--queue", type=int, default=1, help="--train.async_queue_size")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    p.add_argument("--plot", default=str(Path(__file__).resolve().parent / "rl_async_reward.png"))
    args = p.parse_args(argv)
    server = DelayedReward()
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-async-") as tmp:
        work = Path(tmp)
        spec = prepare(args, work)
        base = run(args, spec, server, work, "sync, no delay", 0.0, False)
        g, t = base["generation"], base["train"]
        delay = t if args.delay == "auto" else float(args.delay)
        sync = run(args, spec, server, work, "sync", delay, False)
        asy = run(args, spec, server, work, "async", delay, True)
        asy0 = run(args, spec, server, work, "async, no delay", 0.0, True)
    bound = max(g + t, g + delay, t)
    print(f"# bench/rl_async.py  ({machine()})\n")
    print(f"versions: {versions()}\n")
    print(f"model: llama {args.size} ({spec['num_parameters'] / 1e6:.1f}M), {args.prompts} prompts x "
          f"{args.n} samples x {args.max_new_tokens} tokens per step, queue {args.queue}, {args.steps} steps "
          f"({args.warmup} warm-up), torch threads {args.threads or 'default'}\n")
    print(f"G (generation + scoring compute) {g:.2f} s, T (training) {t:.2f} s, delay D {delay:.2f} s\n")
    rows = [[r["name"], f"{r['delay']:.2f}", f"{r['step']:.2f}", f"{r['generation']:.2f}",
             f"{r['staleness']:.0f}"]
            for r in (base, sync, asy, asy0)]
    print(md_table(["run", "delay s", "step s (median)", "generation s", "max staleness"], rows))
    print(f"\nwith delay: bound max(G+T, G+D, T) = {bound:.2f} s; async {asy['step']:.2f} s = "
          f"{asy['step'] / bound:.2f}x the bound; sync {sync['step']:.2f} s; async / sync = "
          f"{asy['step'] / sync['step']:.2f}x")
    print(f"no delay: async {asy0['step']:.2f} s, sync {base['step']:.2f} s; async / sync = "
          f"{asy0['step'] / base['step']:.2f}x")
    plot([sync, asy], Path(args.plot))
    print(f"\nreward curves (sync vs async, with delay): {args.plot}")


if __name__ == "__main__":
    main()
