"""RL on Ray: step time of `posttrain ppo` with its roles as Ray actor groups vs in one process,
the weight-sync cost per parameter byte, and numpy vs torch through Ray's object store.

    .venv/bin/python bench/rl_ray.py [--size small] [--steps 6] [--warmup 2] [--repeats 2] [--quick]

Configurations (every one trains the same GRPO-style run as `bench/rl_step.py`: a fresh copy of
`build_tiny(dir, "llama", size)` (fp32, sdpa) on the synthetic arithmetic prompts with the chat
template, `prompts` x `n` samples per step, temperature 1, `max_new_tokens` new tokens, the shipped
reward `posttrain/rewards/examples/arithmetic_reward.py`, group_norm advantages, no KL and no
reference model, exactly one optimizer step per rollout in micro-batches of `--micro-batch-size`):

- `in-process`: the default placement (no Ray; the rollout engine samples from the actor's module).
- `ray 1+1 gloo`: `--vllm.num_engines 1` — one actor rank + one rollout engine (`EngineWorker`, the
  HF engine in its own process), weights broadcast actor -> engine over a gloo group (the default;
  `--vllm.sync_backend nccl` falls back to gloo without a GPU).
- `ray 1+1 object store`: the same with `--vllm.sync_with_ray` (the weights go through `ray.put` as
  numpy; the engine loads them from the object store).
- `ray 2+1 zero2`: `--actor.num_gpus_per_node 2 --vllm.num_engines 1 --ds.zero_stage 2` — two actor
  ranks (each a CPU "GPU" with `cores // 2` torch threads) + one engine.
- `in-process + idle ray` (diagnostic, only with `--configs`): the in-process run while a local Ray
  instance that runs nothing (`ray.init` in the same process, its daemons idle) shares the machine —
  the cost of Ray's mere presence, without any transport or weight sync.

Each (configuration, repeat) runs in its own subprocess (`common.run_worker`), in the order above on
even repeats and reversed on odd ones, after the driver waited for the machine to go quiet. The
worker parses the flags with `posttrain.config.parse_config("ppo", argv)`, builds `RLTrainer(cfg)`
(for Ray: starts a local Ray instance, places the groups, each process loads its model), does the
verified weight sync that `RLTrainer.fit()` does before its first step, and then calls
`trainer.step()` `--steps` times, logging each step's metrics as `fit()` does; at the end it
releases the placement (`trainer._release_placement()`, which also shuts Ray down). Start-up (the
process start to the end of that first sync) is timed and printed separately, never mixed into the
step times. A step's wall time is the gap between `common.StepClock` stamps taken right after
consecutive `trainer.step()` calls; the first `--warmup` steps are left out (they include the
workers' first-call costs, e.g. building the gloo sync group); the median of the others is
reported, then the median over repeats. Before each run the driver waits (up to `--max-wait` s)
until no process has `--busy-pattern` (default "pytest") in its command line and the machine is
idle; a run during which such a process appeared is rerun once (`--retries`) and flagged
"(disturbed)" if it still was. `machine CPU busy` = all processes' CPU time during the timed
steps / (seconds x cores), the run's own processes (and Ray's daemons) included; the CPU table
splits it into the trainer process, Ray's worker processes, Ray's daemons and the rest (psutil
snapshots at the two ends of the timed window). The breakdown is the trainer's own `timing/*`
metrics (medians over the timed steps): `generation` (sampling + reward), `make_experience`
(advantages; no actor forward here, since one optimizer step per rollout without KL reuses the
training forward's log-probs), `ppo_train` (experience -> the actor ranks, the optimizer step, and
the weight sync, which is nested inside it) and `weight_sync` (actor -> engine); `rest` = each
step's wall time minus its generation, make_experience and ppo_train (median over the steps).

Weight-sync cost per byte = median `timing/weight_sync` / (number of parameters x 4 bytes, fp32),
in ns/byte, for the gloo broadcast and the object store (and the 2-rank run, which first gathers
the ZeRO-2 shards' full state). The state dict sent holds the tied embedding twice (`embed_tokens`
and `lm_head`), so the bytes that actually move are printed too.

Transport (`--worker transport`, its own process with a local `ray.init`): a representative
experience dict of `--rows` x `--tokens` with 8 arrays (sequences and attention mask int64;
action mask, rollout/old/ref log-probs, advantages, returns float32), once as numpy arrays (what
`trainers/rl/placement/transport.py` sends) and once as torch tensors: `ray.put` in the driver, `ray.get` in
the driver, and an actor method that receives the object ref as its argument (the path of a
`fit` / `logprobs` call) and touches every array; median of `--transport-reps` repetitions each, an
empty actor call as the baseline. The numpy `get` returns read-only views of the object store;
`get + own copy` adds the `np.array` copy + `torch.from_numpy` that `experience_from_numpy` makes.

`--threads 0` (the default) leaves torch at its default thread count in the worker process (the
in-process run and the Ray driver); Ray's processes set their own (`ray_placement.worker_threads`:
cores // ranks of the role). On a 2-core machine nothing here runs two compute-heavy processes at
once except the 2 actor ranks, which split the cores. Not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Poller,
    StepClock,
    add_rl_step_args,
    machine,
    md_table,
    median,
    run_worker,
    versions,
    wait_for_quiet,
)

CONFIGS = {  # name -> extra flags on top of the common GRPO-style run
    "in-process": [],
    "ray 1+1 gloo": ["--vllm.num_engines", "1"],
    "ray 1+1 object store": ["--vllm.num_engines", "1", "--vllm.sync_with_ray"],
    "ray 2+1 zero2": ["--actor.num_gpus_per_node", "2", "--vllm.num_engines", "1", "--ds.zero_stage", "2"],
    "in-process + idle ray": [],  # diagnostic, not in the default --configs
}
DEFAULT_CONFIGS = [c for c in CONFIGS if c != "in-process + idle ray"]
PHASES = ("generation", "make_experience", "ppo_train", "weight_sync", "step_total")


# ---- worker side ---------------------------------------------------------------------------------
def ppo_argv(spec: dict, out_dir: Path, extra: list[str]) -> list[str]:
    """bench/rl_step.py's posttrain command line (the same GRPO-style step), plus `extra`."""
    from rl_step import _posttrain_argv

    return _posttrain_argv(spec, out_dir) + list(extra)


def ray_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by Ray's worker processes (`ray::...`: the role ranks
    and rollout engines) and by Ray's daemons (raylet, gcs_server, log monitor, agents: any other
    process running from the ray package)."""
    import psutil

    out = {"ray workers": 0.0, "ray daemons": 0.0}
    for p in psutil.process_iter(["cmdline", "cpu_times"]):
        cmd, times = p.info["cmdline"] or [], p.info["cpu_times"]
        if times is None or not cmd or p.pid == os.getpid():
            continue
        if cmd[0].startswith("ray::"):
            out["ray workers"] += times.user + times.system
        elif any("site-packages/ray/" in c for c in cmd):
            out["ray daemons"] += times.user + times.system
    return out


def run_trainer_steps(spec: dict, config: str, out_dir: Path, t_start: float) -> dict:
    from posttrain.config import parse_config
    from posttrain.trainers.rl.ppo import RLTrainer

    argv = ppo_argv(spec, out_dir, CONFIGS[config])
    cfg = parse_config("ppo", argv)
    t_build = time.perf_counter()
    if config == "in-process + idle ray":  # a local Ray instance that does nothing, beside the in-process run
        import ray

        ray.init(num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False)
    trainer = RLTrainer(cfg)
    try:
        built = time.perf_counter()
        trainer._sync_engines(verify=True)  # what fit() does before its first step
        synced = time.perf_counter()
        clock, rows, ray_cpu = StepClock(), [], []
        for i in range(spec["steps"]):
            metrics = trainer.step()
            clock.tick()
            if i + 1 in (spec["warmup"], spec["steps"]):  # the ends of the timed window
                ray_cpu.append(ray_cpu_seconds())
            trainer.global_step += 1
            trainer.logger.log(trainer.global_step, metrics)
            rows.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
        trainer.logger.close()
    finally:
        if trainer.reward_source is not None:
            trainer.reward_source.close()
        trainer._release_placement()
        trainer.start.folders.close()
        if config == "in-process + idle ray":
            ray.shutdown()
    return {"clock": clock, "rows": rows, "on_ray": trainer.roles.on_ray, "ray_cpu": ray_cpu,
            "startup": {"imports+parse": t_build - t_start, "RLTrainer(cfg)": built - t_build,
                        "first verified sync": synced - built, "total": synced - t_start},
            "argv": "python -m posttrain.cli.train_ppo_ray " + shlex.join(argv)}


def transport_bench(rows: int, tokens: int, reps: int) -> dict:
    """put / get / actor-read times of one experience dict as numpy and as torch tensors."""
    import numpy as np
    import ray
    import torch

    ray.init(num_cpus=max(os.cpu_count() or 1, 2), include_dashboard=False, log_to_driver=False)
    try:
        g = torch.Generator().manual_seed(0)
        t = {"sequences": torch.randint(0, 2000, (rows, tokens), generator=g),
             "attention_mask": torch.ones(rows, tokens, dtype=torch.long)}
        for k in ("action_mask", "rollout_logp", "old_logp", "ref_logp", "advantages", "returns"):
            t[k] = torch.randn(rows, tokens - 1, generator=g)
        payloads = {"numpy": {k: v.numpy() for k, v in t.items()}, "torch": t}
        nbytes = sum(v.numel() * v.element_size() for v in t.values())

        @ray.remote
        class Reader:
            def read(self, d) -> float:  # touch every element, as a rank building its tensors would
                return float(sum(float(v.sum()) for v in d.values()))

            def noop(self, x) -> int:
                return 0

        reader = Reader.remote()
        ray.get(reader.noop.remote(0))
        out = {"rows": rows, "tokens": tokens, "arrays": len(t), "bytes": nbytes}
        base = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ray.get(reader.noop.remote(0))
            base.append(time.perf_counter() - t0)
        out["empty actor call"] = median(base)
        for kind, payload in payloads.items():
            put, get, own, read = [], [], [], []
            for i in range(reps + 1):  # the first repetition is a warm-up
                t0 = time.perf_counter()
                ref = ray.put(payload)
                t1 = time.perf_counter()
                got = ray.get(ref)
                t2 = time.perf_counter()
                if kind == "numpy":
                    got = {k: torch.from_numpy(np.array(v)) for k, v in got.items()}
                t3 = time.perf_counter()
                ray.get(reader.read.remote(ref))
                t4 = time.perf_counter()
                if i:
                    put.append(t1 - t0)
                    get.append(t2 - t1)
                    own.append(t3 - t1)
                    read.append(t4 - t3)
                del ref, got
            out[kind] = {"put": median(put), "get": median(get), "get + own copy": median(own),
                         "actor reads ref": median(read),
                         "put + get": median([a + b for a, b in zip(put, get)])}
        return out
    finally:
        ray.shutdown()


def worker(args) -> None:
    t_start = time.perf_counter()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker == "transport":
        res = transport_bench(args.rows, args.tokens, args.transport_reps)
        Path(args.result).write_text(json.dumps(res))
        return
    spec = json.loads(Path(args.spec).read_text())
    res = run_trainer_steps(spec, args.worker, Path(args.out), t_start)
    clock, rows = res.pop("clock"), res["rows"]
    w = spec["warmup"]
    wall = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])][w - 1:]  # steps w+1..N
    seconds, steps = clock.window(w)
    busy, cpu = None, None
    if clock.busy[-1] is not None and clock.busy[w - 1] is not None:
        total = clock.busy[-1] - clock.busy[w - 1]
        busy = total / (seconds * (os.cpu_count() or 1))
        start, end = res.pop("ray_cpu")
        cpu = {"driver": clock.own_cpu[-1] - clock.own_cpu[w - 1]}
        cpu.update({k: end[k] - start[k] for k in end})
        cpu["rest of machine"] = total - sum(cpu.values())
        cpu = {k: v / steps for k, v in cpu.items()}  # CPU seconds per timed step
    timed = rows[w:]
    phases = {p: median(r.get(f"timing/{p}", 0.0) for r in timed) for p in PHASES}
    phases["rest"] = median(t - sum(r.get(f"timing/{p}", 0.0)
                                    for p in ("generation", "make_experience", "ppo_train"))
                            for t, r in zip(wall, timed))  # the same step's wall time minus its phases
    res.update({"config": args.worker, "num_threads": torch.get_num_threads(), "step_seconds": wall,
                "median_step": median(wall), "machine_busy": busy, "cpu_per_step": cpu, "phases": phases,
                "reward_mean": [r.get("reward/mean") for r in rows],
                "response_length": [r.get("response/length") for r in rows]})
    Path(args.result).write_text(json.dumps(res))


# ---- driver side ---------------------------------------------------------------------------------
def matching_processes(pattern: str) -> list[int]:
    """Pids (other than this one) whose command line contains `pattern` (read from /proc)."""
    if not pattern:
        return []
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pattern in cmd and int(d.name) != os.getpid():
            out.append(int(d.name))
    return out


def wait_for_no(pattern: str, max_wait: float, interval: float = 10.0) -> bool:
    """Wait (at most `max_wait` s) until no process matches `pattern`; True when none does."""
    deadline = time.monotonic() + max_wait
    while matching_processes(pattern):
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


class Watch(Poller):
    """Polls in a thread, while a run is under way, whether a process matching `pattern` exists."""

    def __init__(self, pattern: str, interval: float = 2.0) -> None:
        super().__init__(interval)
        self.pattern, self.seen = pattern, False

    def poll(self) -> None:
        self.seen = self.seen or bool(matching_processes(self.pattern))


def prepare(args, work: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl
    from posttrain.models import build_tiny

    model = work / "base"
    info = build_tiny(str(model), arch="llama", size=args.size, head="lm", seed=0, verbose=False,
                      overwrite=True)
    write_jsonl(make_arithmetic_rows(args.steps * args.prompts, seed=0), str(work / "data" / "train.jsonl"))
    state = AutoModelForCausalLM.from_pretrained(str(model)).state_dict()
    return {"model": str(model), "data": str(work / "data"), "prompts": args.prompts, "n": args.n,
            "max_new_tokens": args.max_new_tokens, "steps": args.steps, "warmup": args.warmup,
            "micro_batch_size": args.micro_batch_size, "lr": args.lr,
            "num_parameters": info["num_parameters"], "vocab_size": info["vocab_size"],
            "state_dict_bytes": sum(t.numel() * t.element_size() for t in state.values())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rl_step_args(ap, size="small", max_new_tokens=32, steps=6)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads in the worker process (0: torch's default); Ray's processes set "
                         "their own")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma-separated list of: " + ", ".join(CONFIGS) + " (default: all but the last)")
    ap.add_argument("--rows", type=int, default=512, help="transport: experience rows")
    ap.add_argument("--tokens", type=int, default=512, help="transport: tokens per row")
    ap.add_argument("--transport-reps", type=int, default=20)
    ap.add_argument("--max-wait", type=float, default=30.0,
                    help="seconds to wait before each run for the other processes to go idle")
    ap.add_argument("--busy-pattern", default="pytest",
                    help="before each run, wait (up to --max-wait) until no process has this in its command "
                         "line; a run during which one appeared is rerun (--retries) and flagged ('' turns "
                         "this off)")
    ap.add_argument("--retries", type=int, default=1, help="reruns of a run disturbed by --busy-pattern")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: size tiny, 3 steps (1 warm-up), 1 repeat, 4 prompts, 8 new tokens, 5 "
                         "transport reps")
    ap.add_argument("--work-dir", help="keep the model, data, runs and logs here (default: a temp dir)")
    # worker mode (internal)
    ap.add_argument("--worker", choices=[*CONFIGS, "transport"])
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--result")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.size, args.steps, args.warmup, args.repeats, args.prompts = "tiny", 3, 1, 1, 4
        args.max_new_tokens, args.transport_reps = 8, 5
    if args.warmup < 1 or args.steps < args.warmup + 2:
        raise SystemExit("need --warmup >= 1 and --steps >= --warmup + 2")
    if (args.prompts * args.n) % args.micro_batch_size:
        raise SystemExit(f"--prompts x --n = {args.prompts * args.n} must be a multiple of "
                         f"--micro-batch-size")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := [c for c in names if c not in CONFIGS]:
        raise SystemExit(f"unknown --configs {unknown}; valid: {list(CONFIGS)}")

    started = time.perf_counter()
    tmp = None if args.work_dir else tempfile.TemporaryDirectory()
    work = Path(args.work_dir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    spec = prepare(args, work)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    script = Path(__file__).resolve()
    results: dict[str, list[dict]] = {c: [] for c in names}
    failures: list[str] = []
    for r in range(args.repeats):
        for config in (names if r % 2 == 0 else names[::-1]):
            res = None
            for attempt in range(args.retries + 1):
                wait_for_no(args.busy_pattern, args.max_wait)
                quiet = wait_for_quiet(args.max_wait)
                tag = f"{config.replace(' ', '_').replace('+', 'p')}_{r}_{attempt}"
                try:
                    with Watch(args.busy_pattern) as watch:
                        res = run_worker(script, ["--worker", config, "--spec", str(spec_path), "--threads",
                                                  str(args.threads), "--out", str(work / tag)],
                                         work / f"{tag}.log")
                except Exception as e:  # report and go on with the other configurations
                    failures.append(f"{config} (repeat {r}): {e}")
                    print(f"[{datetime.datetime.now():%H:%M:%S}] {config} repeat {r} FAILED:\n{e}",
                          flush=True)
                    res = None
                    break
                res["quiet_before"], res["disturbed"] = quiet, watch.seen
                if not watch.seen:
                    break
                print(f"    ({config} repeat {r}: a '{args.busy_pattern}' process ran meanwhile"
                      + ("; rerunning)" if attempt < args.retries else "; kept, flagged)"), flush=True)
            if res is None:
                continue
            results[config].append(res)
            ph = res["phases"]
            print(f"[{datetime.datetime.now():%H:%M:%S}] {config} repeat {r}: median step "
                  f"{res['median_step']:.3f} s (steps {', '.join(f'{x:.2f}' for x in res['step_seconds'])}); "
                  f"generation {ph['generation']:.3f}, make_experience {ph['make_experience']:.3f}, "
                  f"ppo_train {ph['ppo_train']:.3f}, weight_sync {ph['weight_sync']:.4f}; start-up "
                  f"{res['startup']['total']:.1f} s; process {res['process_seconds']:.0f} s; machine CPU "
                  f"busy {_pct(res['machine_busy'])} (before: {_pct(quiet)})", flush=True)
    transport = None
    wait_for_no(args.busy_pattern, args.max_wait)
    wait_for_quiet(args.max_wait)
    try:
        with Watch(args.busy_pattern) as watch:
            transport = run_worker(script, ["--worker", "transport", "--rows", str(args.rows), "--tokens",
                                            str(args.tokens), "--transport-reps", str(args.transport_reps),
                                            "--threads", str(args.threads)], work / "transport.log")
        transport["disturbed"] = watch.seen
    except Exception as e:
        failures.append(f"transport: {e}")
        print(f"transport FAILED:\n{e}", flush=True)
    print(report(args, spec, results, transport, failures, started))
    if tmp is not None:
        tmp.cleanup()


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{x:.0%}"


def report(args, spec, results, transport, failures, started) -> str:
    ok = {k: v for k, v in results.items() if v}
    med = {k: median(r["median_step"] for r in v) for k, v in ok.items()}
    ph = {k: {p: median(r["phases"][p] for r in v) for p in (*PHASES, "rest")} for k, v in ok.items()}
    lines = ["", "## RL on Ray (bench/rl_ray.py)", ""]
    lines.append(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    lines.append(f"- machine: {machine()}")
    lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()) + ", ray "
                 + _ray_version())
    lines.append(f"- setup: llama {args.size} ({spec['num_parameters']:,} params, vocab "
                 f"{spec['vocab_size']}), {args.prompts} prompts x {args.n} samples = "
                 f"{args.prompts * args.n} per step, max_new_tokens {args.max_new_tokens}, micro-batch "
                 f"{args.micro_batch_size}, group_norm, no KL / no reference, one optimizer step per "
                 f"rollout, {args.steps} steps per run ({args.warmup} warm-up), {args.repeats} repeat(s), "
                 f"each run in its own process")
    lines.append(f"- command: `.venv/bin/python bench/rl_ray.py {shlex.join(argv_of(args))}`")
    lines.append("")
    if ok:
        rows = []
        for k, v in ok.items():
            p = ph[k]
            rows.append([k, f"{med[k]:.3f}", " / ".join(f"{r['median_step']:.3f}" for r in v),
                         f"{p['generation']:.3f}", f"{p['make_experience']:.3f}", f"{p['ppo_train']:.3f}",
                         f"{p['weight_sync']:.4f}", f"{p['rest']:.3f}",
                         " / ".join(f"{r['startup']['total']:.1f}" for r in v),
                         " / ".join(_pct(r["machine_busy"]) + (" (disturbed)" if r["disturbed"] else "")
                                    for r in v)])
        lines.append(md_table(["configuration", "median s/step", "each repeat", "generation",
                               "make_experience", "ppo_train (incl. sync)", "weight_sync", "rest",
                               "start-up s (not in steps)", "machine CPU busy"], rows))
        lines.append("")
        if "in-process" in med:
            for k in ok:
                if k != "in-process":
                    lines.append(f"- **{k} / in-process = {med[k] / med['in-process']:.2f}x** step time"
                                 + (" (goal <= 1.15x)" if k == "ray 1+1 gloo" else ""))
        if "ray 2+1 zero2" in med and "ray 1+1 gloo" in med:
            d = {p: ph["ray 2+1 zero2"][p] - ph["ray 1+1 gloo"][p] for p in PHASES}
            lines.append(f"- **ray 2+1 zero2 / ray 1+1 gloo = "
                         f"{med['ray 2+1 zero2'] / med['ray 1+1 gloo']:.2f}x**; difference per phase (2+1 "
                         f"minus 1+1): "
                         + ", ".join(f"{p} {d[p]:+.3f} s" for p in PHASES if p != "step_total"))
        cpu_rows = []
        for k, v in ok.items():
            if all(r["cpu_per_step"] for r in v):
                c = {key: median(r["cpu_per_step"][key] for r in v) for key in v[0]["cpu_per_step"]}
                cpu_rows.append([k, f"{med[k]:.3f}", *(f"{x:.3f}" for x in c.values()),
                                 f"{sum(c.values()):.3f}", f"{med[k] * (os.cpu_count() or 1):.3f}"])
        if cpu_rows:
            lines.append("")
            lines.append("Where the CPU goes during the timed steps (CPU seconds per step, median over "
                         "repeats; `driver` = the trainer process, `rest of machine` = everything else that "
                         "ran):")
            lines.append("")
            lines.append(md_table(["configuration", "wall s/step", "driver", "ray workers", "ray daemons",
                                   "rest of machine", "total CPU", "cores x wall"], cpu_rows))
            lines.append("")
        lines.append("- start-up split (median over repeats): " + "; ".join(
            f"{k}: " + ", ".join(f"{s} {median(r['startup'][s] for r in v):.1f} s" for s in v[0]["startup"])
            for k, v in ok.items()))
        if "in-process" in ok:
            ref = ok["in-process"][0]
            same = {k: v[0]["reward_mean"] == ref["reward_mean"]
                    and v[0]["response_length"] == ref["response_length"]
                    for k, v in ok.items() if k != "in-process"}
            lines.append("- same per-step reward mean and response length as in-process (repeat 0): "
                         + ", ".join(f"{k} {'yes' if s else 'NO'}" for k, s in same.items()))
        lines.append("")
        sync_rows = []
        param_bytes, sent = spec["num_parameters"] * 4, spec["state_dict_bytes"]
        for k in ("ray 1+1 gloo", "ray 1+1 object store", "ray 2+1 zero2"):
            if k in ph:
                s = ph[k]["weight_sync"]
                sync_rows.append([k, f"{s * 1e3:.1f}", f"{s * 1e9 / param_bytes:.2f}",
                                  f"{s * 1e9 / sent:.2f}", f"{sent / s / 1e9:.2f}" if s > 0 else "-"])
        if sync_rows:
            lines.append(f"Weight sync actor -> engine, per step (median `timing/weight_sync`); parameter "
                         f"bytes = {spec['num_parameters']:,} x 4 = {param_bytes / 2**20:.1f} MiB; "
                         f"state-dict bytes sent = {sent / 2**20:.1f} MiB (tied embedding counted twice):")
            lines.append("")
            lines.append(md_table(["configuration", "weight_sync ms", "ns / parameter byte", "ns / byte sent",
                                   "GB/s sent"], sync_rows))
            lines.append("")
    if transport:
        t = transport
        lines.append(f"Transport through the object store: {t['rows']} rows x {t['tokens']} tokens, "
                     f"{t['arrays']} arrays (2 int64, 6 float32), {t['bytes'] / 2**20:.1f} MiB; median of "
                     f"{args.transport_reps}; empty actor call {t['empty actor call'] * 1e3:.2f} ms"
                     + (f" (a '{args.busy_pattern}' process ran meanwhile)" if t["disturbed"] else "") + ":")
        lines.append("")
        keys = ["put", "get", "put + get", "get + own copy", "actor reads ref"]
        rows = [[kind] + [f"{t[kind][k] * 1e3:.2f}" for k in keys] for kind in ("numpy", "torch")]
        rows.append(["torch / numpy"] + [f"{t['torch'][k] / t['numpy'][k]:.2f}x" if t["numpy"][k] > 0 else "-"
                                         for k in keys])
        lines.append(md_table(["payload", *(f"{k} ms" for k in keys)], rows))
        lines.append("")
    if failures:
        lines.append("Failures:")
        lines += [f"- {f}" for f in failures]
    if ok:
        name, runs = next(iter(ok.items()))
        lines.append(f"- launch ({name}; the others add their flags): `{runs[0]['argv']}`")
    lines.append(f"- total wall time {time.perf_counter() - started:.0f} s")
    return "\n".join(lines)


def _ray_version() -> str:
    try:
        import ray

        return ray.__version__
    except ImportError:
        return "not installed"


def argv_of(args) -> list[str]:
    keys = ("size", "prompts", "n", "max_new_tokens", "micro_batch_size", "steps", "warmup", "repeats", "lr",
            "threads", "rows", "tokens", "transport_reps", "max_wait", "retries")
    out = []
    for k in () if args.quick else keys:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    out += ["--quick"] if args.quick else ["--busy-pattern", args.busy_pattern]
    if args.configs != ",".join(DEFAULT_CONFIGS):
        out += ["--configs", args.configs]
    return out


if __name__ == "__main__":
    main()
