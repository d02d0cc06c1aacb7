"""Memory that scales down: SFT on rows of L tokens with one process, ring attention over 2 ranks and
tensor parallelism over 2 ranks (the `small` preset, CPU, fp32). One RL step on long rows, the same three
ways: `bench/long_context_rl.py`.

    .venv/bin/python bench/long_context.py [--lengths 2048,4096,8192,16384]
        [--configs 1proc,ring2,tp2[,ring2-hs2,dp2]] [--tp-zero-stages 2] [--budget-gib 20] [--steps 3]
        [--rows-per-step 2]
        [--timeout S] [--workdir DIR] [--markdown FILE] [--reuse | --report-only] [--quick]

Model: `posttrain init-tiny --size small` (`build_tiny`, llama, random init, seed 0, fp32), built once into
`WORKDIR/model`; its `max_position_embeddings` is raised to the longest L (rotary embeddings: nothing else
depends on it). Data: for each L, rows of random words from the tiny tokenizer's corpus, each longer than L
tokens, trained with `--model.pretrain_mode_enable --data.max_len L`, so every sample is cut to exactly L
tokens and is the only sample of its packed row (`--ds.packing_samples --train.micro_batch_size 1`).
`--train.batch_size 2` in every configuration by default: a 2-rank ring group (or tensor-parallel group)
takes 2 rows per step, one after the other, one process the same 2 rows (2 micro-batches, gradient
accumulation) and plain data parallelism one row per rank, so every configuration trains on the same rows
in the same steps and the final losses compare. `--rows-per-step 1` trains one row per step (one
micro-batch: no gradient accumulation inside the measured window; `dp2` is skipped). `--steps` (3)
optimizer steps, fp32, sdpa, no eval, no checkpoints; AdamW lr 1e-4, constant schedule.

Configurations (each L of each configuration is a fresh launch; 2 ranks = `torchrun --nproc_per_node 2`,
gloo; torch threads per rank = cores / ranks):
- `1proc`: one process (no ring; posttrain's plain torch engine, as `posttrain sft` picks for one process).
- `ring2`: 2 ranks, `--ds.ring_attn_size 2 --ds.zero_stage 2`: each rank computes one half of the row.
- `tp2`: 2 ranks, `--ds.tensor_parallel_size 2 --ds.zero_stage 2` (`--tp-zero-stages 0,1,2` runs each
  stage). Where this checkout reports the flag as having no effect (its "has no effect" / "not available"
  note, found by parsing the configuration without running, or in a run's stderr), the rows say
  "n/a (flag not available in this checkout)" and nothing runs: after tensor parallelism lands, the same
  command measures it.
- `ring2-hs2` (optional): `ring2` with `--ds.ring_attn_head_stride 2` (both key/value heads of the small
  preset gathered in one call: one attention call per layer instead of two).
- `dp2` (optional): 2 ranks plain data parallel with ZeRO-2, one whole row per rank (reference: the same
  engine as the ring, no split).

Measured per rank, by a wrapper that runs `posttrain.cli.train_sft.main` in the rank's process with global
hooks (`StepProbe`): a forward pre-hook on every module, armed at the start and after each optimizer step,
marks a step's start: it hands free heap pages back (`malloc_trim`), reads VmRSS (the first step's = the
RSS before the first training step: model + optimizer + engine), then writes "5" to /proc/self/clear_refs,
which resets the kernel's high-water mark (VmHWM) to the current RSS. An optimizer pre-step hook reads VmHWM
= the step's peak (forward, backward, gradient reduction; the optimizer's own update comes after), this
rank's ring traffic so far (bytes, seconds) and the live parameter + optimizer tensor bytes
(`bench/memory.py`'s `watch_optimizer_steps`: every CPU tensor storage alive before the optimizer step,
largest over the steps, i.e. with Adam's moments from step 2 on). A post-step hook stamps the step's end.
- `peak`: the largest VmHWM of the process (set-up, every step, the end).
- `before step 1`: VmRSS at the first step's start; `baseline`: VmRSS after the imports, before the model.
- `activation` = step peak - RSS at the step's start, the largest over steps 2..N (activations, gradients,
  the ring's gathered keys / values and attention masks, allocator temporaries; step 1 also holds one-off
  allocations that stay, ~50 MiB here, so it is left out as the time is).
- `saved act.`: the activations proper, independent of the allocator: a saved-tensor hook
  (`torch.autograd.graph.saved_tensors_hooks`, around the whole run) adds up the storages autograd keeps for
  the backward during one micro-batch (the outermost module's forward starts one), each storage once, the
  parameters' own storages left out; the largest micro-batch of the step, the largest over steps 2..N. It
  leaves out what the step peak also holds: gradients, the engine's reduce buffers, the backward's
  temporaries and the allocator's slack. (With gradient checkpointing the recomputed forwards would be
  counted as well; the bench does not use it.)
- `s/step`: median of steps 2..N (a step's time = from the previous step's end; step 1 from its start).
- `cp MiB/step`, `cp s/step`: `comm/cp_bytes` / `comm/cp_seconds` from the run's metrics.jsonl (rank 0's,
  median of steps 2..N); the final `train/loss` as a sanity check (ring 2 = one process, same data).
Ratios: ring2 / 1proc of the per-rank activation at each L (goal <= 0.6 at 8k; also against dp2, the same
ZeRO-2 engine without the split); tp2 / 1proc of the per-rank parameter + optimizer live tensors (goal <=
0.6). Rank balance of ring 2: each rank's step time, the seconds it spent in the ring's collectives (they
include waiting for the other rank), the difference, and its CPU time per step (less disturbed
by outside load).

The longest row that fits: per configuration, L goes up in powers of two while the extrapolated peak of the
next L (summed over the ranks) fits `--budget-gib` (default 20 GiB for the machine): with two measurements,
growth at most quadratic in L gives next = last + 4 x (last - previous); with one, next = before + 4 x
(peak - before) with `before` the RSS before step 1. A watchdog kills a launch whose processes together hold
more than the budget (sampled every 0.2 s), and one that runs past `--timeout`. `--quick`: lengths 512 and
1024, a smoke test of a minute or two. Each launch's result is kept in `WORKDIR/results/`: `--reuse` skips the
launches found there, `--report-only` runs nothing and prints the report of what is there.
Not a test: nothing asserts.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, Poller, _bench_env, machine, md_table, median, versions  # noqa: E402
from memory import live_tensor_bytes, proc_status, step_live_bytes, watch_optimizer_steps  # noqa: E402

sys.path.insert(0, str(REPO))

GIB, MIB = 2**30, 2**20
SEED = 0
TP_NA = "n/a (flag not available in this checkout)"
# name -> (ranks, extra flags); "tp2" gets its ZeRO stage from --tp-zero-stages
CONFIGS = {
    "1proc": (1, []),
    "ring2": (2, ["--ds.ring_attn_size", "2", "--ds.zero_stage", "2"]),
    "ring2-hs2": (2, ["--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "2", "--ds.zero_stage", "2"]),
    "tp2": (2, ["--ds.tensor_parallel_size", "2"]),
    "dp2": (2, ["--ds.zero_stage", "2"]),
}


# ---- worker side: one rank of one launch -----------------------------------------------------------
def _trim_heap() -> None:
    from posttrain.utils.memory import release_freed_memory

    release_freed_memory()


def _reset_hwm() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class StepProbe:
    """Global hooks marking each training step's start (first module forward after the previous optimizer
    step) and peak (optimizer pre-step) in this process (module doc)."""

    def __init__(self) -> None:
        self.armed = True
        self.steps: list[dict] = []  # per step: rss_start, hwm_before_reset, peak, cp, t/cpu start, end
        self.hwm_reset = None
        self.top = None  # the outermost module: its forward starts each micro-batch
        self.params: set[int] = set()  # the parameters' storages (saved by reference, not activations)
        self.saved: dict[int, int] = {}  # this micro-batch's saved storages: data_ptr -> bytes
        self.saved_max = 0  # the largest micro-batch's saved bytes in this step

    def pack(self, tensor):
        """Saved-tensor hook: count each storage autograd keeps for the backward once per micro-batch."""
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params:
            self.saved.setdefault(ptr, storage.nbytes())
        return tensor

    def _micro_batch(self, module) -> None:
        self.saved_max = max(self.saved_max, sum(self.saved.values()))
        self.saved = {}
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_module_forward_pre_hook(self._forward_pre)
        register_optimizer_step_pre_hook(self._step_pre)
        register_optimizer_step_post_hook(self._step_post)

    def _forward_pre(self, module, args):
        if self.top is None:
            self.top = module
        if module is self.top:
            self._micro_batch(module)
        if not self.armed:
            return None
        self.armed = False
        self.saved_max = 0
        _trim_heap()
        before = proc_status()
        self.hwm_reset = _reset_hwm()
        self.steps.append({"hwm_before_reset": before.get("VmHWM"), "rss_start": proc_status().get("VmRSS"),
                           "t_start": time.perf_counter(), "cpu_start": time.process_time()})
        return None

    def _step_pre(self, optimizer, args, kwargs):
        if self.steps and "peak" not in self.steps[-1]:
            from posttrain.models.context_parallel import _traffic

            self.saved_max = max(self.saved_max, sum(self.saved.values()))
            self.steps[-1].update(peak=proc_status().get("VmHWM"), cp_bytes=_traffic["bytes"],
                                  cp_seconds=_traffic["seconds"], saved=self.saved_max)

    def _step_post(self, optimizer, args, kwargs):
        if self.steps and "t_end" not in self.steps[-1]:
            self.steps[-1].update(t_end=time.perf_counter(), cpu_end=time.process_time())
            self.armed = True

    def summary(self) -> dict:
        steps = [s for s in self.steps if "peak" in s and "t_end" in s]
        seconds = [s["t_end"] - (steps[i - 1]["t_end"] if i else s["t_start"]) for i, s in enumerate(steps)]
        cpu = [s["cpu_end"] - (steps[i - 1]["cpu_end"] if i else s["cpu_start"]) for i, s in enumerate(steps)]
        return {"forward_marks": len(self.steps), "steps": len(steps), "hwm_reset": self.hwm_reset,
                # whose forward starts a micro-batch (the model)
                "micro_batch_module": type(self.top).__name__,
                "rss_before_step1": steps[0]["rss_start"] if steps else None,
                "rss_start": [s["rss_start"] for s in steps], "step_peak": [s["peak"] for s in steps],
                "activation": [s["peak"] - s["rss_start"] for s in steps],
                "saved": [s["saved"] for s in steps], "step_seconds": seconds, "step_cpu_seconds": cpu,
                "cp_bytes": [s["cp_bytes"] for s in steps], "cp_seconds": [s["cp_seconds"] for s in steps],
                "hwm_readings": [s["hwm_before_reset"] for s in self.steps]}


def worker(args) -> None:
    import torch  # (the baseline is read after the heavy imports)
    import transformers  # noqa: F401

    from posttrain.cli import train_sft

    spec = json.loads(Path(args.spec).read_text())
    rank = int(os.environ.get("RANK", "0"))
    baseline = proc_status()
    probe = StepProbe()
    probe.install()
    watch_optimizer_steps()  # after the probe's hook: VmHWM is read before the live-tensor scan allocates
    with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda tensor: tensor):
        train_sft.main(spec["argv"])
    end = proc_status()
    out = probe.summary()
    out.update(rank=rank, baseline=baseline["VmRSS"], end=end,
               peak=max([end["VmHWM"], *[h for h in out["hwm_readings"] if h], *out["step_peak"]]),
               param_opt_live=(step_live_bytes() or [None])[0], live_end=live_tensor_bytes()[0],
               threads=torch.get_num_threads())
    Path(f"{args.result}.rank{rank}.json").write_text(json.dumps(out))


# ---- driver side ---------------------------------------------------------------------------------
def build_model(work: Path, longest: int) -> Path:
    """The `small` preset, built once (`posttrain init-tiny --size small`); positions raised to `longest`."""
    from posttrain.models import build_tiny

    model = work / "model"
    if not (model / "config.json").exists():
        build_tiny(str(model), arch="llama", size="small", head="lm", seed=SEED, verbose=False,
                   overwrite=True)
    config = json.loads((model / "config.json").read_text())
    if config.get("max_position_embeddings", 0) < longest:
        config["max_position_embeddings"] = longest
        (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def write_rows(work: Path, length: int, count: int) -> Path:
    """`count` rows of random lines of the tiny tokenizer's corpus, each of more than `length` tokens (so
    `--data.max_len length` cuts every sample to exactly `length`)."""
    from posttrain.data.synthetic import write_jsonl
    from posttrain.models.tiny_corpus import tiny_corpus

    folder = work / "data" / f"L{length}"
    if not (folder / "train.jsonl").exists():
        lines, rng = tiny_corpus(), random.Random(SEED + length)
        rows = []
        for _ in range(count):
            text, words = [], 0
            while words < 1.1 * length + 16:  # every word is at least one token
                text.append(rng.choice(lines))
                words += len(text[-1].split())
            rows.append({"text": " ".join(text)})
        write_jsonl(rows, str(folder / "train.jsonl"))
    return folder


def sft_argv(model: Path, data: Path, out: Path, length: int, batch: int, steps: int,
             extra: list[str]) -> list[str]:
    return ["--model.model_name_or_path", str(model), "--model.pretrain_mode_enable",
            "--data.dataset", str(data), "--data.input_key", "text", "--data.max_len", str(length),
            "--data.max_samples", str(steps * batch), "--ds.packing_samples",
            "--train.batch_size", str(batch), "--train.micro_batch_size", "1", "--train.max_epochs", "1",
            "--train.seed", "42", "--adam.lr", "1e-4", "--lr_scheduler", "constant",
            "--ds.param_dtype", "fp32", "--ds.attn_implementation", "sdpa",
            "--ckpt.output_dir", str(out), "--ckpt.save_steps", "-1", "--logger.logging_steps", "1", *extra]


def config_flags(name: str, tp_zero: int) -> tuple[int, list[str]]:
    ranks, flags = CONFIGS["tp2" if name.startswith("tp2") else name]
    if name.startswith("tp2"):
        flags = flags + ["--ds.zero_stage", str(tp_zero)]
    return ranks, flags


ROWS_PER_STEP = 2  # --train.batch_size of every configuration (module doc; --rows-per-step)


def flag_unavailable(argv: list[str], ranks: int, flag: str = "--ds.tensor_parallel_size") -> str | None:
    """posttrain's note that `flag` has no effect in this checkout, from parsing the configuration as `ranks`
    ranks would (nothing runs), else None. A configuration that does not parse here is left to the run
    (its stderr is checked too)."""
    from posttrain.config import parse_config
    from posttrain.config.inert import inert_flags

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(ranks)
    try:
        notes = [n for n in inert_flags(parse_config("sft", argv), "cpu") if n.startswith(flag)]
    except Exception:  # noqa: BLE001
        notes = []
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved
    return notes[0] if notes else None


def unavailable_in_log(text: str, flag: str = "--ds.tensor_parallel_size") -> str | None:
    for line in text.splitlines():
        if flag in line and ("has no effect" in line or "not available" in line):
            return line.strip()
    return None


class TreeWatch(Poller):
    """Peak summed RSS of a process and its descendants, and each one's own peak (with its Ray class for Ray
    workers, from the process title); kills the process tree above `limit` bytes summed."""

    def __init__(self, proc: subprocess.Popen, limit: float, interval: float = 0.2) -> None:
        super().__init__(interval)
        self.proc, self.limit, self.peak, self.killed = proc, limit, 0, False
        self.peaks: dict[int, int] = {}  # pid -> its largest RSS
        self.titles: dict[int, str] = {}  # pid -> "ray::ClassName" for Ray workers

    def poll(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        for p in procs:
            try:
                rss, title = p.memory_info().rss, " ".join(p.cmdline())
            except psutil.Error:
                continue
            total += rss
            self.peaks[p.pid] = max(self.peaks.get(p.pid, 0), rss)
            # idle and busy titles differ ("ray::RoleWorker.fit"): keep the class
            if title.startswith("ray::"):
                self.titles[p.pid] = title.split()[0].split(".")[0]
        self.peak = max(self.peak, total)
        if total > self.limit and not self.killed:
            self.killed = True
            kill_tree(self.proc.pid)

    def by_title(self, title: str, count: int) -> list[int]:
        """The `count` largest peaks of the processes titled `title` (Ray may start a spare worker too)."""
        return sorted(self.peaks[pid] for pid, t in self.titles.items() if t == title)[-count:]


@contextlib.contextmanager
def work_folder(workdir: str | None, prefix: str):
    """`workdir` (made if missing), or a temporary folder removed afterwards."""
    if workdir:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)


def publish(text: str, markdown: str | None) -> None:
    """Print the report, and write it to `markdown` when given."""
    print("\n" + text)
    if markdown:
        Path(markdown).write_text(text)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (torchrun's workers run in sessions of their own)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def free_port() -> str:
    with socket.socket() as sock:  # torchrun's --master_port 0 does not reach the workers
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def launch(ranks: int, spec_path: Path, result: Path, log: Path, limit: float, timeout: float) -> dict:
    """Run the worker on `ranks` ranks (torchrun over gloo for 2), under the memory watchdog."""
    script = [str(Path(__file__).resolve()), "--worker", "--spec", str(spec_path), "--result", str(result)]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", free_port(), *script]
    else:
        cmd = [sys.executable, *script]
    threads = max(1, (os.cpu_count() or 1) // ranks)
    env = dict(_bench_env(), OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x))
    for old in result.parent.glob(result.name + ".rank*.json"):
        old.unlink()
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        with TreeWatch(proc, limit) as watch:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                rc = proc.wait()
    text = log.read_text(errors="replace")
    res = {"rc": rc, "killed": watch.killed, "tree_peak": watch.peak, "wall": time.perf_counter() - t0,
           "unavailable": unavailable_in_log(text)}
    files = sorted(result.parent.glob(result.name + ".rank*.json"))
    res["ranks"] = [json.loads(f.read_text()) for f in files]
    if rc != 0 or len(files) != ranks:
        res["error"] = ("killed by the watchdog: the processes held more than the budget" if watch.killed
                        else f"exit {rc}: {error_line(text)}")
    return res


def error_line(log: str) -> str:
    """posttrain's own error line from a failed launch's log, else its last line."""
    lines = [x.strip() for x in log.splitlines() if x.strip()]
    mine = [x for x in lines if "error:" in x or x.startswith(("RuntimeError", "ValueError", "posttrain"))]
    return ((mine or lines or ["(no output)"])[0])[:300]


def read_metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "train/loss" in r]


def run_one(args, work: Path, model: Path, name: str, length: int) -> dict:
    """One launch of configuration `name` at row length `length` (reused from
    WORKDIR/results with --reuse)."""
    cached = work / "results" / f"{name}_L{length}.json"
    if (args.reuse or args.report_only) and cached.exists():
        return {"finished": cached.stat().st_mtime, **json.loads(cached.read_text())}
    tp_zero = int(name.split("-zero")[1]) if "-zero" in name else args.tp_zero_stages[0]
    ranks, flags = config_flags(name, tp_zero)
    if name == "dp2" and args.rows_per_step % ranks:
        return {"name": name, "length": length,
                "skipped": f"--rows-per-step {args.rows_per_step}: dp2 takes one row per rank"}
    data = write_rows(work, length, args.steps * args.rows_per_step)
    out = work / "runs" / f"{name}_L{length}"
    argv = sft_argv(model, data, out, length, args.rows_per_step, args.steps, flags)
    if name.startswith("tp2") and (why := flag_unavailable(argv, ranks)):
        return {"name": name, "length": length, "na": why, "argv": argv}
    if args.report_only:
        return {"name": name, "length": length, "skipped": "not run (--report-only)"}
    spec = work / "runs" / f"{name}_L{length}.spec.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"argv": argv}))
    res = launch(ranks, spec, work / "runs" / f"{name}_L{length}.result",
                 work / "runs" / f"{name}_L{length}.log", args.budget_gib * GIB, args.timeout)
    res.update(name=name, length=length, argv=argv, ranks_n=ranks, metrics=read_metrics(out),
               finished=time.time())
    if name.startswith("tp2") and res.get("unavailable"):
        res["na"] = res["unavailable"]
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(res))
    return res


def total_peak(res: dict) -> int:
    return sum(r["peak"] for r in res["ranks"])


def next_peak(history: list[dict]) -> float | None:
    """Extrapolated summed peak at twice the last length, growth at most quadratic (module doc)."""
    ok = [h for h in history if h.get("ranks") and "error" not in h]
    if not ok:
        return None
    last = total_peak(ok[-1])
    if len(ok) >= 2 and ok[-2]["length"] * 2 == ok[-1]["length"]:
        return last + 4 * max(0, last - total_peak(ok[-2]))
    before = sum(r["rss_before_step1"] for r in ok[-1]["ranks"])
    return before + 4 * max(0, last - before)


def sweep(args, work: Path, model: Path) -> dict[str, list[dict]]:
    """Every configuration over the lengths, length-major (partial results cover every configuration)."""
    results: dict[str, list[dict]] = {n: [] for n in args.configs}
    stopped: dict[str, str] = {}
    for length in args.lengths:
        for name in args.configs:
            if name in stopped:
                results[name].append({"name": name, "length": length, "skipped": stopped[name]})
                continue
            est = next_peak(results[name])
            if est is not None and est > args.budget_gib * GIB:
                stopped[name] = f"extrapolated peak {est / GIB:.1f} GiB > budget {args.budget_gib:g} GiB"
                results[name].append({"name": name, "length": length, "skipped": stopped[name],
                                      "estimate": est})
                print(f"[{name} L={length}] skipped: {stopped[name]}", flush=True)
                continue
            t0 = time.perf_counter()
            res = run_one(args, work, model, name, length)
            res["estimate"] = est
            results[name].append(res)
            print(f"[{datetime.datetime.now():%H:%M:%S}] {name} L={length}: {one_line(res)} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if "na" in res:
                stopped[name] = TP_NA
            elif "skipped" in res:
                stopped[name] = res["skipped"]
            elif "error" in res:
                stopped[name] = f"L={length} failed: {res['error']}"
    return results


# ---- report --------------------------------------------------------------------------------------
def _g(x) -> str:
    return "-" if x is None else f"{x / GIB:.2f}"


def _timed(values: list, skip: int = 1) -> float | None:
    values = [v for v in values if v is not None]
    return median(values[skip:]) if len(values) > skip else (values[-1] if values else None)


def per_rank(res: dict) -> list[dict]:
    """The figures of each rank of a finished launch."""
    out = []
    for r in sorted(res["ranks"], key=lambda r: r["rank"]):
        out.append({"rank": r["rank"], "peak": r["peak"], "before": r["rss_before_step1"],
                    "baseline": r["baseline"], "activation": max(r["activation"][1:] or r["activation"]),
                    "param_opt": r["param_opt_live"],
                    "saved": max(r["saved"][1:] or r["saved"]) if r.get("saved") else None,
                    "seconds": _timed(r["step_seconds"]), "cp_seconds": _timed(r["cp_seconds"]),
                    "cpu": _timed(r["step_cpu_seconds"]), "threads": r["threads"]})
    return out


def one_line(res: dict) -> str:
    if "na" in res:
        return f"n/a: {res['na']}"
    if "skipped" in res:
        return f"skipped: {res['skipped']}"
    if "error" in res:
        return f"FAILED: {res['error']}"
    ranks = per_rank(res)
    return (f"peak {' / '.join(_g(r['peak']) for r in ranks)} GiB, activation "
            f"{' / '.join(_g(r['activation']) for r in ranks)} GiB, s/step "
            f"{_secs(ranks)}, loss {final_loss(res)}")


def _secs(ranks: list[dict]) -> str:
    return " / ".join("-" if r["seconds"] is None else f"{r['seconds']:.1f}" for r in ranks)


def final_loss(res: dict) -> str:
    m = res.get("metrics") or []
    return f"{m[-1]['train/loss']:.4f}" if m else "-"


def _metric(res: dict, key: str) -> float | None:
    return _timed([m.get(key) for m in res.get("metrics") or []])


def table_rows(results: dict[str, list[dict]]) -> list[list[str]]:
    one = {r["length"]: r for r in results.get("1proc", []) if r.get("ranks") and "error" not in r}
    rows = []
    for length in sorted({r["length"] for runs in results.values() for r in runs}):
        for name, runs in results.items():
            res = next((r for r in runs if r["length"] == length), None)
            if res is None:
                continue
            label = f"`{name}`"
            if "na" in res:
                rows.append([label, length, TP_NA, *[""] * 13])
                continue
            if "skipped" in res or "error" in res:
                rows.append([label, length, "skipped" if "skipped" in res else "FAILED",
                             res.get("skipped") or res.get("error"), *[""] * 12])
                continue
            ranks, base = per_rank(res), one.get(length)
            act = max(r["activation"] for r in ranks)
            po = max(r["param_opt"] or 0 for r in ranks)
            saved = max(r["saved"] or 0 for r in ranks)
            act_ratio = po_ratio = saved_ratio = "-"
            if base is not None and name != "1proc":
                b = per_rank(base)[0]
                act_ratio, po_ratio = f"{act / b['activation']:.2f}x", f"{po / b['param_opt']:.2f}x"
                saved_ratio = f"{saved / b['saved']:.2f}x" if saved and b["saved"] else "-"
            cp_b, cp_s = _metric(res, "comm/cp_bytes"), _metric(res, "comm/cp_seconds")
            rows.append([label, length, len(ranks), " / ".join(_g(r["peak"]) for r in ranks),
                         " / ".join(_g(r["before"]) for r in ranks),
                         " / ".join(_g(r["param_opt"]) for r in ranks),
                         " / ".join(_g(r["activation"]) for r in ranks), act_ratio,
                         " / ".join(_g(r["saved"]) if r["saved"] else "-" for r in ranks), saved_ratio,
                         po_ratio, _secs(ranks), "-" if cp_b is None else f"{cp_b / MIB:,.0f}",
                         "-" if cp_s is None else f"{cp_s:.2f}", final_loss(res), _g(total_peak(res))])
    return rows


def longest_fit(results: dict[str, list[dict]], lengths: list[int]) -> list[str]:
    out = []
    for name, runs in results.items():
        ran = [r["length"] for r in runs if r.get("ranks") and "error" not in r and "na" not in r]
        if not ran:
            continue
        top = max(ran)
        more = "" if top < max(lengths) or any("skipped" in r or "error" in r for r in runs) else \
            f" (the longest tried; the next would need an extrapolated {next_peak(runs) / GIB:.1f} GiB)"
        why = next((r.get("skipped") or r.get("error") for r in runs if "skipped" in r or "error" in r), None)
        out.append(f"- longest row that ran, `{name}`: **{top:,} "
                   f"tokens**{more}" + (f"; stopped: {why}" if why else ""))
    return out


def balance_lines(results: dict[str, list[dict]]) -> list[str]:
    out = []
    for res in [r for name in results if name.startswith("ring2") for r in results[name]]:
        if not res.get("ranks") or "error" in res:
            continue
        parts = [f"rank {r['rank']}: step {r['seconds']:.2f} s, in collectives {r['cp_seconds']:.2f} s, "
                 f"other {r['seconds'] - r['cp_seconds']:.2f} s, CPU {r['cpu']:.2f} s" for r in per_rank(res)]
        out.append(f"- {res['name']} L={res['length']:,} (median of steps 2..N): " + "; ".join(parts))
    return out


def ratio_lines(results: dict[str, list[dict]]) -> list[str]:
    def by_length(name):
        return {r["length"]: per_rank(r) for r in results.get(name, []) if r.get("ranks")
                and "error" not in r}

    one, dp = {k: v[0] for k, v in by_length("1proc").items()}, by_length("dp2")
    out = []
    pairs = [(n, goal, key) for n in results if n.startswith("ring2")
             for goal, key in (("activation (step peak - start)", "activation"),
                               ("saved activations", "saved"))]
    pairs += [(n, "parameter + optimizer", "param_opt") for n in results if n.startswith("tp2")]
    for name, goal, key in pairs:
        for res in results.get(name, []):
            if res.get("ranks") and "error" not in res and res["length"] in one and one[res["length"]][key]:
                mine = max(r[key] or 0 for r in per_rank(res))
                vs_dp = ""
                if res["length"] in dp and all(r[key] for r in dp[res["length"]]):
                    vs_dp = (f"; vs dp2 (ZeRO-2, whole row per rank) "
                             f"{mine / max(r[key] for r in dp[res['length']]):.2f}x")
                out.append(f"- {name} / 1proc, per-rank {goal} at L={res['length']:,}: "
                           f"**{mine / one[res['length']][key]:.2f}x** (goal <= 0.6){vs_dp}")
            elif "na" in res and res["length"] == min(one, default=0):
                out.append(f"- {name}: {TP_NA} — {res['na']}")
    return out


def run_dates(results: dict[str, list[dict]], started) -> str:
    """When the launches ran (from their results: with --reuse / --report-only, when they were measured)."""
    ends = [(r["finished"], r.get("wall", 0)) for runs in results.values() for r in runs if r.get("finished")]
    if not ends:
        return f"{started:%Y-%m-%d %H:%M} UTC"
    utc = datetime.timezone.utc
    first = datetime.datetime.fromtimestamp(min(e - w for e, w in ends), utc)
    last = datetime.datetime.fromtimestamp(max(e for e, _ in ends), utc)
    return f"{first:%Y-%m-%d %H:%M}-{last:%H:%M} UTC"


def command_line(args) -> str:
    cmd = ["--lengths", ",".join(map(str, args.lengths)), "--configs", ",".join(args.configs),
           "--steps", str(args.steps), "--budget-gib", f"{args.budget_gib:g}"]
    if args.tp_zero_stages != [2]:
        cmd += ["--tp-zero-stages", ",".join(map(str, args.tp_zero_stages))]
    if args.rows_per_step != ROWS_PER_STEP:
        cmd += ["--rows-per-step", str(args.rows_per_step)]
    return ".venv/bin/python bench/long_context.py " + shlex.join(cmd)


def report(args, results, started, vers) -> str:
    lines = ["## Long rows: ring attention and tensor parallelism (`bench/long_context.py`)", "",
             f"- command: `{command_line(args)}`",
             f"- date: {run_dates(results, started)}",
             f"- machine: {machine()}, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.1f} "
             f"GiB; torch threads per rank = cores / ranks (shared with other work: times are indicative)",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()),
             f"- setup: `small` preset (build_tiny seed 0), rows of exactly L tokens, one per packed "
             f"micro-batch, {args.rows_per_step} row(s) per step in every configuration (pretrain mode, "
             f"packing), {args.steps} steps, fp32, sdpa, AdamW lr 1e-4; 2 ranks = torchrun + gloo, ZeRO-2 "
             f"(tp2: ZeRO {','.join(map(str, args.tp_zero_stages))}); memory budget {args.budget_gib:g} GiB "
             f"(sum over ranks)", "",
             "Per-rank columns read `rank 0 / rank 1`. peak = VmHWM of the whole run; before step 1 = VmRSS "
             "at the first step's start; param+opt = live tensor bytes before the optimizer step; activation "
             "= step peak - RSS at the step's start (largest of steps 2..N); saved act. = the bytes of the "
             "storages autograd saved for the backward in one micro-batch, parameters excluded (largest over "
             "steps 2..N); ratios vs `1proc` at the same L (activation, param+opt); cp = `comm/cp_bytes` / "
             "`comm/cp_seconds` per step (metrics.jsonl, rank 0).", "",
             md_table(["config", "L", "ranks", "peak GiB", "before step 1 GiB", "param+opt GiB",
                       "activation GiB", "act. vs 1proc", "saved act. GiB", "saved vs 1proc",
                       "param+opt vs 1proc", "s/step", "cp MiB/step", "cp s/step", "final loss",
                       "peak, sum of ranks GiB"], table_rows(results)), ""]
    lines += ratio_lines(results) + longest_fit(results, args.lengths) + balance_lines(results)
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096,8192,16384",
                    help="row lengths in tokens, comma-separated")
    ap.add_argument("--configs", default="1proc,ring2,tp2", help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--tp-zero-stages", default="2", help="ZeRO stages to run tp2 with (0, 1, 2), "
                                                          "comma-separated")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per launch (step 1 is not timed)")
    ap.add_argument("--rows-per-step", type=int, default=ROWS_PER_STEP,
                    help="rows per optimizer step (--train.batch_size); 1: one micro-batch per step, no "
                         "accumulation")
    ap.add_argument("--budget-gib", type=float, default=20.0,
                    help="memory for the whole launch (sum over ranks)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    ap.add_argument("--quick", action="store_true", help="smoke test: lengths 512,1024")
    ap.add_argument("--workdir", help="model, data, runs, results (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true", help="reuse WORKDIR/results/<config>_L<L>.json when "
                                                         "present")
    ap.add_argument("--report-only", action="store_true", help="run nothing: the report of WORKDIR/results")
    ap.add_argument("--markdown", help="also write the markdown section to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: one rank
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    if args.quick:
        args.lengths = "512,1024"
    args.lengths = sorted(int(x) for x in args.lengths.split(",") if x.strip())
    args.tp_zero_stages = [int(x) for x in args.tp_zero_stages.split(",") if x.strip()]
    configs = []
    for c in (x.strip() for x in args.configs.split(",") if x.strip()):
        if c not in CONFIGS:
            ap.error(f"--configs: unknown {c!r}; valid: {', '.join(CONFIGS)}")
        configs += ([f"tp2-zero{z}" for z in args.tp_zero_stages] if c == "tp2"
                    and len(args.tp_zero_stages) > 1 else [c])
    args.configs = configs
    if args.steps < 2:
        ap.error("--steps must be at least 2 (step 1 is not timed)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    started = datetime.datetime.now(datetime.timezone.utc)
    with work_folder(args.workdir, "bench_long_") as work:
        model = build_model(work, max(args.lengths))
        print(f"workdir {work}; model {model}", flush=True)
        results = sweep(args, work, model)
        publish(report(args, results, started, versions()), args.markdown)


if __name__ == "__main__":
    main()
