"""Helpers shared by the benchmark scripts: versions, subprocess workers, step clocks, tables.

A benchmark is not a test: nothing here asserts on timings."""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def versions() -> dict[str, str]:
    """Library versions that matter for a training benchmark (plus the posttrain git revision)."""
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__}
    try:
        import trl

        out["trl"] = trl.__version__
    except ImportError:
        out["trl"] = "not installed"
    import posttrain

    rev = git_revision()
    out["posttrain"] = getattr(posttrain, "__version__", "?") + (f" (git {rev})" if rev else "")
    return out


def git_revision() -> str | None:
    """Short HEAD hash of the repository, with '+dirty' when the tree has changes (read-only git calls)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> str:
    import torch

    return (f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, "
            f"torch.get_num_threads()={torch.get_num_threads()}, no GPU")


def cpu_busy_seconds() -> float | None:
    """Busy CPU time of the whole machine (all processes, all cores) from /proc/stat, in seconds;
    None where /proc/stat does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # user..steal; guest is inside user


class Baton:
    """Worker side of the round-robin hand-off: `pass_and_wait(done)` tells the driver this worker
    reached a hand-off point (b"r", or b"d" after its last step) and blocks until the driver says go.
    Without the driver's file descriptors in the environment it does nothing."""

    def __init__(self) -> None:
        ready, go = os.environ.get("BENCH_READY_FD"), os.environ.get("BENCH_GO_FD")
        self.fds = (int(ready), int(go)) if ready and go else None

    def pass_and_wait(self, done: bool = False) -> None:
        if self.fds is None:
            return
        os.write(self.fds[0], b"d" if done else b"r")
        if os.read(self.fds[1], 1) != b"g":
            raise RuntimeError("the benchmark driver went away")


class StepClock:
    """Stamps taken right after each optimizer step: wall (`perf_counter`), this process's CPU time
    (all threads) and the machine's busy CPU time.

    `window(skip)` = (seconds, steps) between the end of step `skip` and the end of the last step,
    i.e. the time of steps skip+1..N, leaving the first `skip` steps out as warm-up.
    `others_share(skip)` = CPU time other processes used in that window / (seconds x cores): 0 on an
    otherwise idle machine; 0.5 on 2 cores means another process kept one core busy throughout."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.own_cpu: list[float] = []
        self.busy: list[float | None] = []

    def tick(self) -> None:
        self.stamps.append(time.perf_counter())
        self.own_cpu.append(time.process_time())
        self.busy.append(cpu_busy_seconds())

    def window(self, skip: int = 1) -> tuple[float, int]:
        if len(self.stamps) <= skip:
            raise ValueError(f"need more than {skip} optimizer steps to time, got {len(self.stamps)}")
        return self.stamps[-1] - self.stamps[skip - 1], len(self.stamps) - skip

    def others_share(self, skip: int = 1) -> float | None:
        seconds, _ = self.window(skip)
        if self.busy[-1] is None or self.busy[skip - 1] is None or seconds <= 0:
            return None
        others = (self.busy[-1] - self.busy[skip - 1]) - (self.own_cpu[-1] - self.own_cpu[skip - 1])
        return max(0.0, others / (seconds * (os.cpu_count() or 1)))


class TurnClock:
    """Per-step timing of a training loop: call `tick()` right after each optimizer step.

    With a `Baton`, the worker hands the CPU over after step 1, after every `chunk`-th step and after
    the last step; a step's time runs from the end of the previous step, or from the moment the worker
    got the CPU back, to its own end — so time spent parked while another worker ran never counts.
    For each step it also records this process's CPU time and the machine's busy CPU time.

    `window(skip)` = (seconds, steps) summed over steps skip+1..N (the first `skip` are warm-up).
    `others_share(skip)` = CPU time other processes used during those steps / (seconds x cores): 0
    on an otherwise idle machine; 0.5 on 2 cores = another process kept one core busy throughout."""

    def __init__(self, total_steps: int, baton: Baton | None = None, chunk: int = 5) -> None:
        self.total, self.baton, self.chunk = total_steps, baton, chunk
        self.steps: list[tuple[float, float, float | None]] = []  # (seconds, own cpu, machine busy) per step
        self._mark = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float | None]:
        return time.perf_counter(), time.process_time(), cpu_busy_seconds()

    def tick(self) -> None:
        end = self._now()
        busy = None if end[2] is None or self._mark[2] is None else end[2] - self._mark[2]
        self.steps.append((end[0] - self._mark[0], end[1] - self._mark[1], busy))
        n = len(self.steps)
        if self.baton is not None and (n == 1 or n % self.chunk == 0 or n >= self.total):
            self.baton.pass_and_wait(done=n >= self.total)
            end = self._now()
        self._mark = end

    def window(self, skip: int = 1) -> tuple[float, int]:
        if len(self.steps) <= skip:
            raise ValueError(f"need more than {skip} optimizer steps to time, got {len(self.steps)}")
        return sum(s[0] for s in self.steps[skip:]), len(self.steps) - skip

    def others_share(self, skip: int = 1) -> float | None:
        seconds, _ = self.window(skip)
        timed = self.steps[skip:]
        if any(s[2] is None for s in timed) or seconds <= 0:
            return None
        others = sum(s[2] - s[1] for s in timed)
        return max(0.0, others / (seconds * (os.cpu_count() or 1)))


def wait_for_quiet(max_wait: float, threshold: float = 0.1, interval: float = 1.0) -> float:
    """Wait (at most `max_wait` s) until the machine's busy share over one `interval` is below
    `threshold` (other processes idle); return the last measured share (nan without /proc/stat)."""
    deadline = time.monotonic() + max_wait
    cores = os.cpu_count() or 1
    while True:
        a = cpu_busy_seconds()
        time.sleep(interval)
        b = cpu_busy_seconds()
        if a is None or b is None:
            return float("nan")
        share = (b - a) / (interval * cores)
        if share < threshold or time.monotonic() >= deadline:
            return share


def _bench_env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")


def _log_tail(path: Path, lines: int = 40) -> str:
    return "".join(path.read_text(errors="replace").splitlines(True)[-lines:])


def run_worker(script: Path, args: list[str], log_path: Path, timeout: float = 900) -> dict:
    """Run `python script --worker ... --result R` in a fresh process; return the JSON it wrote to R.
    stdout/stderr go to `log_path`; on failure its tail is raised with the error."""
    result = log_path.with_suffix(".json")
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run([sys.executable, str(script), *args, "--result", str(result)], check=False,
                              cwd=REPO, env=_bench_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"worker {' '.join(args)} failed (exit {proc.returncode}); log {log_path}:\n"
                           f"{_log_tail(log_path)}")
    out = json.loads(result.read_text())
    out["process_seconds"] = time.perf_counter() - t0
    return out


def run_round_robin(commands: list[list[str]], logs: list[Path], timeout: float = 1800) -> list[dict]:
    """Run several worker processes so that only one trains at a time, taking turns.

    Every worker is started at once and does its set-up and first (warm-up) step concurrently with the
    others (untimed); then the driver lets them run one at a time, in turns of a few steps (each turn
    ends at the worker's `Baton` hand-off), rotating the order each round, until all reached their last
    step; then all are released to finish (export, exit) concurrently. Outside load therefore hits all
    of them alike. Each command gets `--result <log>.json`; returns those JSON results in order."""

    procs, results = [], [log.with_suffix(".json") for log in logs]
    try:
        for cmd, log, res in zip(commands, logs, results):
            res.unlink(missing_ok=True)
            r_ready, w_ready = os.pipe()
            r_go, w_go = os.pipe()
            env = dict(_bench_env(), BENCH_READY_FD=str(w_ready), BENCH_GO_FD=str(r_go))
            with log.open("w") as out:
                p = subprocess.Popen([sys.executable, *cmd, "--result", str(res)], cwd=REPO, env=env,
                                     stdout=out, stderr=subprocess.STDOUT, pass_fds=(w_ready, r_go))
            os.close(w_ready)
            os.close(r_go)
            procs.append((p, r_ready, w_go, log))

        def receive(k: int) -> bytes:
            msg = os.read(procs[k][1], 1)
            if msg not in (b"r", b"d"):
                raise RuntimeError(f"worker {' '.join(commands[k][1:3])} stopped early; log {logs[k]}:\n"
                                   f"{_log_tail(logs[k])}")
            return msg

        done = [receive(k) == b"d" for k in range(len(procs))]  # everyone set up and past step 1
        order = list(range(len(procs)))
        while not all(done):
            for k in order:
                if not done[k]:
                    os.write(procs[k][2], b"g")
                    done[k] = receive(k) == b"d"
            order = order[1:] + order[:1]
        for p, _, w_go, _ in procs:
            os.write(w_go, b"g")
        for k, (p, *_rest) in enumerate(procs):
            if p.wait(timeout=timeout) != 0 or not results[k].exists():
                raise RuntimeError(f"worker {' '.join(commands[k][1:3])} failed (exit {p.returncode}); log "
                                   f"{logs[k]}:\n{_log_tail(logs[k])}")
        return [json.loads(r.read_text()) for r in results]
    finally:
        for p, r_ready, w_go, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for fd in (r_ready, w_go):
                try:
                    os.close(fd)
                except OSError:
                    pass


def add_rl_step_args(ap, *, size: str, max_new_tokens: int, steps: int) -> None:
    """The RL-step flags bench/rl_step.py and bench/rl_ray.py share (a run = `steps` steps of
    `prompts` x `n` samples on the `size` preset; the first `warmup` steps are not timed)."""
    ap.add_argument("--size", default=size, help="build_tiny preset")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (rollout batch)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--micro-batch-size", type=int, default=32, help="train / log-prob micro-batch")
    ap.add_argument("--steps", type=int, default=steps, help="steps per run, warm-up included")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing (>= 1)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)


def median(values) -> float:
    return float(statistics.median(values))


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; numbers are expected pre-formatted as strings."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def trl_step_callback(clock, lrs: list):
    """A transformers TrainerCallback recording the learning rate each optimizer step will use into
    `lrs` and calling `clock.tick()` at each step's end."""
    from transformers import TrainerCallback

    class StepCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kw):
            lrs.append(float(optimizer.param_groups[0]["lr"]))

        def on_step_end(self, args, state, control, **kw):
            clock.tick()

    return StepCallback()


def trl_training_args(spec: dict, out_dir) -> dict:
    """The TRL config fields the SFT and DPO benches share with posttrain's side: CPU, fp32, the
    global batch as micro-batch x accumulation, AdamW (0.9, 0.95, 1e-8, no decay), clip 1.0,
    cosine_with_min_lr with ceil(steps * warmup_ratio) warm-up steps (posttrain's rounding),
    sequential sampling, no eval / checkpoints / reporting, log every step."""
    steps = spec["steps"]
    return dict(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=spec["batch_size"] // spec["micro_batch_size"],
        max_steps=steps, learning_rate=spec["lr"], optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": spec["min_lr_ratio"]},
        warmup_steps=math.ceil(steps * spec["warmup_ratio"]), seed=spec["seed"],
        train_sampling_strategy="sequential", eval_strategy="no", save_strategy="no", report_to="none",
        logging_steps=1, dataloader_num_workers=0, dataloader_pin_memory=False)


def trl_grpo_args(spec: dict, out_dir, *, beta: float, seed: int) -> dict:
    """The TRL `GRPOConfig` fields the RL benches share with posttrain's side: CPU, fp32, one optimizer step
    over the whole rollout (`prompts` x `n` samples in micro-batches), `n` generations per prompt, temperature
    1 without top-p/top-k, the step's token mean (`loss_type="dapo"`), group-scaled rewards, clip 0.2, KL
    weight `beta`, AdamW (0.9, 0.95, 1e-8, no decay), clip-norm 1.0, no warm-up, no vLLM / eval / checkpoints
    / reporting, log every step. The LR schedule is the caller's (`lr_scheduler_type`)."""
    total, mbs = spec["prompts"] * spec["n"], spec["micro_batch_size"]
    return dict(
        output_dir=str(out_dir), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=mbs, gradient_accumulation_steps=total // mbs,
        generation_batch_size=total, num_generations=spec["n"], num_iterations=1, shuffle_dataset=False,
        max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=0,
        beta=beta, loss_type="dapo", scale_rewards="group", epsilon=0.2, use_vllm=False,
        max_steps=spec["steps"], learning_rate=spec["lr"], optim="adamw_torch", adam_beta1=0.9,
        adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, warmup_steps=0, seed=seed,
        eval_strategy="no", save_strategy="no", report_to="none", logging_steps=1, log_completions=False,
        dataloader_num_workers=0, dataloader_pin_memory=False)


class Poller:
    """A context manager calling `poll()` in a daemon thread every `interval` s while it is open (a
    subclass defines `poll`)."""

    def __init__(self, interval: float) -> None:
        import threading

        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def poll(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def add_round_robin_args(p, workers: list[str]) -> None:
    """The flags every round-robin bench shares: waiting for a quiet machine, the work folder, the
    markdown output, torch threads per worker (`set_threads(spec)` in the worker), and the internal flags
    a worker process is launched with."""
    import argparse

    p.add_argument("--chunk", type=int, default=5, help="optimizer steps per turn in the round-robin")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    p.add_argument("--max-wait", type=float, default=30.0,
                   help="seconds to wait before each repeat for other processes to go idle")
    p.add_argument("--workdir", default=None, help="folder for model, data, logs (default: a temp dir)")
    p.add_argument("--markdown", default=None, help="also write the markdown section to this file")
    p.add_argument("--worker", choices=workers, help=argparse.SUPPRESS)  # internal: one side in this process
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)


PLUS = "posttrain+"  # the side that runs posttrain's default configuration plus --posttrain-flags


def add_posttrain_flags_arg(p) -> None:
    """--posttrain-flags: also time the side `posttrain+` (posttrain's default configuration plus these
    flags) in the same run, so that a flag's effect is read against the same outside load."""
    p.add_argument("--posttrain-flags", default=None,
                   help=f"also time posttrain with these extra flags (side `{PLUS}`), e.g. "
                        "--posttrain-flags=--ds.no_onednn_linear")


def posttrain_flags(args) -> list[str]:
    return shlex.split(args.posttrain_flags or "")


def side_flags(spec: dict, side: str) -> list[str]:
    """The extra posttrain flags of a worker side: spec["posttrain_flags"] for `posttrain+`, else none."""
    return list(spec.get("posttrain_flags") or []) if side == PLUS else []


def plus_lines(spec: dict, speed: dict[str, list[float]], steps: dict[str, list[list[float]]],
               cpu: dict[str, list[list[float]]] | None = None) -> list[str]:
    """Markdown bullets for a run with a `posttrain+` side: what it is, and its speed against `posttrain`
    and TRL. `speed` = side -> one speed per repeat (higher = faster: tokens/s, 1 / s-per-step); `steps` =
    side -> per repeat, the seconds of each timed step. The per-repeat ratios give the run-to-run spread;
    the per-step ratio (the same step of the same repeat, i.e. the same batch; median over all of them)
    is robust to the stalls of a few seconds that outside load puts into single steps. `cpu` (optional) = the
    same with each step's CPU time of the worker process: with one torch thread, much less disturbed by
    outside load than wall time (the process only counts while it runs)."""
    if PLUS not in speed:
        return []
    lines = [f"- `{PLUS}` = posttrain's default configuration plus `{shlex.join(spec['posttrain_flags'])}`"]
    for num, den in (("posttrain", PLUS), (PLUS, "trl")):
        if den in speed:
            each = [a / b for a, b in zip(speed[num], speed[den])]
            def per_step(clock):
                return median(b / a for ra, rb in zip(clock[num], clock[den]) for a, b in zip(ra, rb))

            cpu_text = f"; CPU time per step, median ratio: {per_step(cpu):.3f}" if cpu else ""
            lines.append(f"- speed {num} / {den}: **{median(speed[num]) / median(speed[den]):.3f}x** (each "
                         f"repeat: {', '.join(f'{v:.3f}' for v in each)}; per step, median: "
                         f"{per_step(steps):.3f}{cpu_text}; > 1 = {num} faster)")
    return lines


def set_threads(spec: dict) -> None:
    """In a worker: torch.set_num_threads(spec["threads"]) unless it is 0 (torch's default)."""
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])


def check_step_args(p, args) -> None:
    """Refuse a global batch that is not whole micro-batches, and runs with no timed step."""
    if args.batch_size % args.micro_batch_size:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --micro-batch-size "
                f"{args.micro_batch_size}")
    if args.steps < 2:
        p.error("--steps must be at least 2 (step 1 is excluded as warm-up)")
