"""Mixture of experts vs dense at the same active parameters: an SFT step and a GRPO step, time and memory.

    PYTHONPATH=. .venv/bin/python bench/moe.py [--sizes small,base] [--only sft|rl|blocks] [--repeats 2]
        [--sft-steps 8] [--rl-steps 4] [--threads 1] [--quick] [--workdir DIR] [--markdown FILE]

Models (random init, fp32, sdpa, one per preset `--sizes`): `build_tiny(dir, arch="llama", size=S)` (dense)
and `build_tiny(dir, arch="qwen3_moe", size=S)` (`posttrain init-tiny --moe`): the preset's attention, and in
every layer 4 experts of half the preset's MLP width, 2 per token, so the MoE's ACTIVE parameters equal the
dense model's (+ the router, and Qwen3's q/k norms) while its total is larger. Both use the same tokenizer.
The tables give total and active parameters (active = total - the unchosen experts' share, (E - k) / E, of
every expert block's parameters), counted on the meta device.

1. SFT step (`posttrain.cli.train_sft.main`, through bench/sft.py's `run_posttrain`, one process each): sides
   `dense`, `moe` and `moe+aux` (`--model.aux_loss_coef 0.01`), on the same synthetic arithmetic rows in the
   same order (bench/sft.py's recipe: chat template, loss on the completion, global batch 32 = micro-batch 8 x
   4, max_len 64, AdamW, cosine with warm-up), `--sft-steps` optimizer steps; the first is warm-up.
2. RL step (`posttrain ppo` in one process, GRPO = group_norm, through bench/rl_step.py's `run_posttrain`: no
   TRL): sides `dense` and `moe+aux` (`--actor.aux_loss_coef 0.01`; `--rl-sides` adds `moe`), 8 prompts x 4
   samples, 16 new tokens, one optimizer step per rollout, `--rl-steps` steps of which `--rl-warmup` are
   warm-up. posttrain's own `timing/*` metrics (metrics.jsonl) give the split generation /
   experience / update.
3. Components (in the driver process, one thread, CPU time, variants interleaved over `--block-rounds`): one
   layer's MLP block, forward + backward of `--block-tokens` rows — the dense MLP with posttrain's oneDNN
   linears (its default) and with `F.linear`, the MoE router alone, the MoE block with transformers'
   `grouped_mm` and `eager` experts kernels — and one optimizer step (clip + AdamW) over each whole model:
   where the extra time of a MoE step goes.

Interleaving: for each size and task a repeat starts one process per side at once; they set up and run their
first step concurrently (untimed), then take turns (`common.run_round_robin`): one trains while the others
wait on a pipe, `--chunk` SFT steps (1 RL step) per turn, the order rotating each round: dense, MoE, dense,
MoE... so outside load on a shared machine hits every side alike. A step's time (`common.TurnClock`) runs from
the end of the previous step, or from getting the CPU back, to its own end; its own CPU time is recorded too.
Reported per side: the median step over the timed steps of all repeats; MoE / dense ratios as the median of
per-repeat ratios (with the spread over repeats) and of per-step ratios (the same step of the same repeat:
the same batch).

Memory per worker process (/proc/self/status): `baseline` = VmRSS after the imports, before any model is
loaded; `peak` = VmHWM at the end (the kernel's high-water mark of the resident set, set-up and all steps);
`peak - baseline` is the part the run's tensors and allocator took. `16 B x params` = fp32 parameters +
gradients + Adam's two moments of the trained model, for reference. Not a test: nothing asserts on
time or memory.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_step  # noqa: E402
import sft  # noqa: E402
from common import (  # noqa: E402
    Baton,
    TurnClock,
    add_round_robin_args,
    machine,
    md_table,
    median,
    run_round_robin,
    set_threads,
    versions,
    wait_for_quiet,
)
from memory import GIB, proc_status  # noqa: E402

AUX = "0.01"
# side -> (model kind, extra posttrain flags)
SFT_SIDES = {"dense": ("dense", []), "moe": ("moe", []), "moe+aux": ("moe", ["--model.aux_loss_coef", AUX])}
RL_SIDES = {"dense": ("dense", []), "moe": ("moe", []), "moe+aux": ("moe", ["--actor.aux_loss_coef", AUX])}
ARCH = {"dense": "llama", "moe": "qwen3_moe"}


# ---- worker side ---------------------------------------------------------------------------------
def metric_rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def sft_worker(spec: dict, side: str, out_dir: Path, clock: TurnClock) -> dict:
    """One SFT run of `side` (bench/sft.py's posttrain side); per-step tokens from its collator records."""
    kind, extra = SFT_SIDES[side]
    res = sft.run_posttrain(dict(spec, model=spec["models"][kind]), False, out_dir, clock,
                            extra + spec.get("flags", []))
    ga = spec["batch_size"] // spec["micro_batch_size"]
    micro = res.pop("micro")[: spec["steps"] * ga]
    tokens = [sum(m["tokens"] for m in micro[i * ga:(i + 1) * ga]) for i in range(spec["steps"])]
    aux = [r["train/aux_loss"] for r in metric_rows(out_dir) if "train/aux_loss" in r]
    return {"step_tokens": tokens, "final_loss": res["losses"][-1], "aux_loss": aux, "argv": res["argv"]}


def rl_worker(spec: dict, side: str, out_dir: Path, clock: TurnClock) -> dict:
    """One GRPO run of `side` (bench/rl_step.py's posttrain side); posttrain's timing/* per step."""
    kind, extra = RL_SIDES[side]
    res = rl_step.run_posttrain(dict(spec, model=spec["models"][kind]), out_dir, None,
                                extra + spec.get("flags", []), clock=clock)
    rows = [r for r in metric_rows(out_dir) if "timing/step_total" in r]
    timing = {k: [r.get(k) for r in rows]
              for k in sorted({k for r in rows for k in r if k.startswith("timing/")})}
    aux = [r["actor/aux_loss"] for r in rows if "actor/aux_loss" in r]
    return {"timing": timing, "gen_tokens": res["gen_tokens"], "aux_loss": aux, "argv": res["argv"],
            "reward_mean": [x for x in res["reward_mean"] if x is not None]}


def worker(args) -> None:
    import importlib

    import torch

    importlib.import_module("posttrain.cli." + ("train_sft" if args.worker == "sft" else "train_ppo_ray"))
    baseline = proc_status()  # after the heavy imports, before any model is loaded
    spec = json.loads(Path(args.spec).read_text())
    set_threads(spec)
    clock = TurnClock(spec["steps"], Baton(), chunk=spec["chunk"])
    run = sft_worker if args.worker == "sft" else rl_worker
    res = run(spec, args.side, Path(args.out), clock)
    if len(clock.steps) != spec["steps"]:
        raise RuntimeError(f"{args.side}: {len(clock.steps)} steps, expected {spec['steps']}")
    res.update({"side": args.side, "num_threads": torch.get_num_threads(), "baseline": baseline,
                "end": proc_status(), "step_seconds": [s[0] for s in clock.steps],
                "step_cpu_seconds": [s[1] for s in clock.steps],
                "others_share": clock.others_share(spec["warmup"])})
    Path(args.result).write_text(json.dumps(res))


# ---- driver side ---------------------------------------------------------------------------------
def param_counts(model_dir: str) -> dict[str, int]:
    """Total parameters and active ones per token: a sparse block's experts count (k / E)
    of their elements."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from posttrain.models.moe import is_moe, text_config

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    if is_moe(config):
        c = text_config(config)
        experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts")
        share = (experts - c.num_experts_per_tok) / experts
        inactive = sum(share * sum(p.numel() for p in m.experts.parameters()) for m in model.modules()
                       if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router")))
    return {"total": total, "active": round(total - inactive)}


def build_models(work: Path, size: str) -> dict[str, dict]:
    from posttrain.models import build_tiny

    out = {}
    for kind, arch in ARCH.items():
        folder = work / "models" / f"{kind}-{size}"
        if not (folder / "config.json").exists():
            build_tiny(str(folder), arch=arch, size=size, head="lm", seed=0, verbose=False, overwrite=True)
        out[kind] = {"path": str(folder), **param_counts(str(folder))}
    return out


def write_data(folder: Path, n: int, difficulty: int) -> str:
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    write_jsonl(make_arithmetic_rows(n, seed=42, difficulty=difficulty), str(folder / "train.jsonl"))
    return str(folder)


def sft_spec(args, work: Path, models: dict) -> dict:
    n = args.sft_steps * args.batch_size  # one epoch of `sft_steps` full global batches
    return {"models": {k: v["path"] for k, v in models.items()}, "data": write_data(work / "data_sft", n, 4),
            "steps": args.sft_steps, "warmup": 1, "batch_size": args.batch_size,
            "micro_batch_size": args.micro_batch_size, "max_len": 64, "lr": 1e-3, "warmup_ratio": 0.1,
            "min_lr_ratio": 0.1, "seed": 42, "chunk": args.chunk, "threads": args.threads,
            "flags": flags(args)}


def rl_spec(args, work: Path, models: dict) -> dict:
    data = write_data(work / "data_rl", args.rl_steps * args.prompts, 0)
    return {"models": {k: v["path"] for k, v in models.items()}, "data": data, "prompts": args.prompts,
            "n": args.n, "max_new_tokens": args.max_new_tokens, "micro_batch_size": args.rl_micro_batch_size,
            "lr": 1e-5, "steps": args.rl_steps, "warmup": args.rl_warmup, "chunk": 1, "threads": args.threads,
            "flags": flags(args)}


def flags(args) -> list[str]:
    return shlex.split(args.flags or "")


def run_task(args, work: Path, task: str, size: str, spec: dict, sides: list[str]) -> dict[str, list[dict]]:
    """`args.repeats` round-robin runs of every side; side -> one result per repeat."""
    spec_path = work / f"{task}-{size}.spec.json"
    spec_path.write_text(json.dumps(spec))
    results: dict[str, list[dict]] = {s: [] for s in sides}
    script = str(Path(__file__).resolve())
    for rep in range(args.repeats):
        quiet = wait_for_quiet(args.max_wait)
        order = sides if rep % 2 == 0 else sides[::-1]
        tags = [f"{task}-{size}-{side}-{rep}" for side in order]
        runs = run_round_robin([[script, "--worker", task, "--side", side, "--spec", str(spec_path), "--out",
                                 str(work / tag)] for side, tag in zip(order, tags)],
                               [work / f"{t}.log" for t in tags])
        print(f"[{datetime.datetime.now():%H:%M:%S}] {task} {size} repeat {rep + 1}/{args.repeats} (others' "
              f"CPU share before: {quiet:.0%})", flush=True)
        for side, res in zip(order, runs):
            results[side].append(res)
            timed = res["step_seconds"][spec["warmup"]:]
            print(f"  {side:<8} median step {median(timed):.3f} s (steps "
                  f"{', '.join(f'{x:.2f}' for x in timed)}); peak RSS {res['end']['VmHWM'] / GIB:.2f} GiB; "
                  f"others' CPU share {res['others_share'] or 0:.0%}", flush=True)
    return results


# ---- MLP block micro-benchmark (driver process) ----------------------------------------------------
def block_times(models: dict, tokens: int, rounds: int) -> dict[str, float]:
    """Median CPU milliseconds (this process, torch threads as set) of one layer's MLP block, forward +
    backward on `tokens` rows of random hidden states, the variants interleaved over `rounds` rounds: the
    dense MLP with posttrain's oneDNN linears (its default) and with torch's `F.linear`; the MoE router alone;
    the MoE block with transformers' `grouped_mm` (its default) and `eager` (a Python loop over the
    hit experts) kernels."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.cpu_linear import use_onednn_linears

    dense = AutoModelForCausalLM.from_pretrained(models["dense"]["path"],
                                                 dtype=torch.float32).model.layers[0].mlp
    onednn = copy.deepcopy(dense)
    use_onednn_linears(onednn)
    block = AutoModelForCausalLM.from_pretrained(models["moe"]["path"],
                                                 dtype=torch.float32).model.layers[0].mlp
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, block.gate.hidden_dim, generator=gen)
    grad = torch.randn(1, tokens, block.gate.hidden_dim, generator=gen)

    def run_block(module, kernel=None):
        if kernel:
            block.experts.config._experts_implementation = kernel
        xx = x.clone().requires_grad_()
        module(xx).backward(grad)

    def run_router():
        xx = x.clone().requires_grad_()
        logits, scores, _ = block.gate(xx.view(tokens, -1))
        (logits.sum() + scores.sum()).backward()

    variants = {"dense MLP (oneDNN linears, posttrain's default)": lambda: run_block(onednn),
                "dense MLP (F.linear, --ds.no_onednn_linear)": lambda: run_block(dense),
                "MoE router alone (linear, softmax, top-k)": run_router,
                **{f"MoE block, experts `{k}`": (lambda k=k: run_block(block, k))
                   # batched_mm copies each row's expert weights: GiBs here
                   for k in ("grouped_mm", "eager")}}
    return interleaved_cpu_ms(variants, rounds)


def interleaved_cpu_ms(calls: dict, rounds: int) -> dict[str, float]:
    """Median CPU milliseconds of each call, the calls taking turns for `rounds` rounds after
    a warm-up round."""
    seconds: dict[str, list[float]] = {k: [] for k in calls}
    for r in range(rounds + 1):  # round 0 is warm-up
        for name, fn in calls.items():
            t0 = time.process_time()
            fn()
            if r:
                seconds[name].append(time.process_time() - t0)
    return {k: 1000 * median(v) for k, v in seconds.items()}


def optimizer_times(models: dict, rounds: int) -> dict[str, float]:
    """Median CPU milliseconds of one optimizer step over a whole model, as posttrain's TorchEngine does it
    (global-norm clipping to 1.0, then torch AdamW betas (0.9, 0.95), no decay), gradients random; dense and
    MoE interleaved. The state exists from round 0 (warm-up) on."""
    import torch
    from transformers import AutoModelForCausalLM

    steps = {}
    for kind in ("dense", "moe"):
        model = AutoModelForCausalLM.from_pretrained(models[kind]["path"], dtype=torch.float32)
        params = list(model.parameters())
        for q in params:
            q.grad = torch.randn_like(q)
        opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

        def step(params=params, opt=opt):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        steps[f"optimizer step (clip + AdamW), whole {kind} model"] = step
    return interleaved_cpu_ms(steps, rounds)


def block_table(size: str, blocks: dict[str, float], optim: dict[str, float], layers: int) -> str:
    ref = blocks["dense MLP (oneDNN linears, posttrain's default)"]
    rows = [[size, name, f"{ms:.2f}", f"{ms / ref:.2f}", f"{ms * layers:.0f}"] for name, ms in blocks.items()]
    ref = next(iter(optim.values()))
    rows += [[size, name, f"{ms:.2f}", f"{ms / ref:.2f}", "-"] for name, ms in optim.items()]
    return md_table(["size", "variant", "CPU ms", "x dense", f"x {layers} layers (ms)"], rows)


# ---- summary -------------------------------------------------------------------------------------
def timed(res: dict, key: str, warmup: int) -> list[float]:
    return res[key][warmup:]


def side_summary(runs: list[dict], warmup: int) -> dict:
    return {"step": median(x for r in runs for x in timed(r, "step_seconds", warmup)),
            "cpu": median(x for r in runs for x in timed(r, "step_cpu_seconds", warmup)),
            "each": [median(timed(r, "step_seconds", warmup)) for r in runs],
            "peak": median(r["end"]["VmHWM"] for r in runs),
            "growth": median(r["end"]["VmHWM"] - r["baseline"]["VmRSS"] for r in runs),
            "others": max(r["others_share"] or 0.0 for r in runs)}


def ratio_text(runs: dict[str, list[dict]], num: str, den: str, warmup: int) -> str:
    """MoE / dense: step time (wall and the worker's CPU time) as the median of per-repeat ratios with their
    range, and per step (the same step of the same repeat); for RL also posttrain's generation and update
    phases; peak RSS and peak - baseline."""
    a, b = runs[num], runs[den]

    def per_repeat(key):
        return [median(timed(x, key, warmup)) / median(timed(y, key, warmup)) for x, y in zip(a, b)]

    def spread(values):
        return f"**{median(values):.2f}x** (repeats {min(values):.2f}-{max(values):.2f})"

    step = [p / q for x, y in zip(a, b)
            for p, q in zip(timed(x, "step_seconds", warmup), timed(y, "step_seconds", warmup))]
    sa, sb = side_summary(a, warmup), side_summary(b, warmup)
    text = (f"`{num}` / `{den}`: wall step time {spread(per_repeat('step_seconds'))}, per step "
            f"{median(step):.2f}x (range {min(step):.2f}-{max(step):.2f}); CPU time per step "
            f"{spread(per_repeat('step_cpu_seconds'))}")
    if "timing" in a[0]:
        phases = []
        for k in ("generation", "ppo_train"):
            def phase(r, k=k):
                return median(x for x in r["timing"].get(f"timing/{k}", [])[warmup:] if x is not None)
            phases.append(f"`timing/{k}` {median(phase(x) / phase(y) for x, y in zip(a, b)):.2f}x")
        text += "; " + ", ".join(phases)
    return text + (f"; peak RSS **{sa['peak'] / sb['peak']:.2f}x**, peak - baseline "
                   f"{sa['growth'] / sb['growth']:.2f}x (+{(sa['growth'] - sb['growth']) / GIB:.2f} GiB)")


def _params(models: dict, kind: str) -> list[str]:
    return [f"{models[kind]['total'] / 1e6:.2f}M", f"{models[kind]['active'] / 1e6:.2f}M",
            f"{16 * models[kind]['total'] / GIB:.2f}"]


def sft_table(size: str, models: dict, runs: dict[str, list[dict]], spec: dict) -> str:
    rows = []
    for side, rs in runs.items():
        s = side_summary(rs, 1)
        tokens = median(sum(timed(r, "step_tokens", 1)) / sum(timed(r, "step_seconds", 1)) for r in rs)
        aux = rs[0]["aux_loss"]
        rows.append([size, f"`{side}`", *_params(models, SFT_SIDES[side][0]), f"{s['step']:.3f}",
                     " / ".join(f"{x:.3f}" for x in s["each"]), f"{s['cpu']:.3f}", f"{tokens:,.0f}",
                     f"{s['peak'] / GIB:.2f}", f"{s['growth'] / GIB:.2f}", f"{rs[0]['final_loss']:.3f}",
                     f"{aux[-1]:.3f}" if aux else "-", f"{s['others']:.0%}"])
    return md_table(["size", "side", "total params", "active params", "16 B x params GiB", "median s/step",
                     "each repeat", "CPU s/step", "tokens/s", "peak RSS GiB", "peak - baseline GiB",
                     "final loss", "aux loss (last)", "others' CPU (max)"], rows)


def rl_table(size: str, models: dict, runs: dict[str, list[dict]], spec: dict) -> str:
    w, rows = spec["warmup"], []
    for side, rs in runs.items():
        s = side_summary(rs, w)
        phase = {k: median(x for r in rs for x in r["timing"].get(f"timing/{k}", [])[w:] if x is not None)
                 if rs[0]["timing"].get(f"timing/{k}") else float("nan")
                 for k in ("generation", "make_experience", "ppo_train")}
        aux = rs[0]["aux_loss"]
        rows.append([size, f"`{side}`", *_params(models, RL_SIDES[side][0]), f"{s['step']:.3f}",
                     " / ".join(f"{x:.3f}" for x in s["each"]), f"{s['cpu']:.3f}",
                     *(f"{phase[k]:.3f}" for k in phase), f"{s['peak'] / GIB:.2f}",
                     f"{s['growth'] / GIB:.2f}", f"{aux[-1]:.3f}" if aux else "-", f"{s['others']:.0%}"])
    return md_table(["size", "side", "total params", "active params", "16 B x params GiB", "median s/step",
                     "each repeat", "CPU s/step", "timing/generation", "timing/make_experience",
                     "timing/ppo_train", "peak RSS GiB", "peak - baseline GiB", "aux loss (last)",
                     "others' CPU (max)"], rows)


def report(args, started, sections: list[str]) -> str:
    cmd = "PYTHONPATH=. .venv/bin/python bench/moe.py " + shlex.join(sys.argv[1:])
    head = ["## Mixture of experts vs dense (`bench/moe.py`)", "", f"Command: `{cmd}`  ",
            f"Date: {started:%Y-%m-%d %H:%M} UTC  ", f"Machine: {machine()}  ",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()), ""]
    if args.only == "blocks":
        return "\n".join(head + sections)
    head += [f"Setup: dense = `build_tiny(arch='llama', size=S)`, MoE = `build_tiny(arch='qwen3_moe', "
             f"size=S)` (4 experts "
            f"of half the MLP width, 2 per token; the transformers default experts kernel), random init, "
            f"fp32, sdpa; torch threads per worker {args.threads or 'default'}; {args.repeats} repeat(s), "
            f"each a round-robin of one process per side (turns of {args.chunk} SFT / 1 RL step). SFT: "
            f"global batch {args.batch_size} = micro-batch {args.micro_batch_size} x "
            f"{args.batch_size // args.micro_batch_size}, max_len 64, arithmetic rows (difficulty 4), "
            f"{args.sft_steps} steps (1 warm-up). RL: GRPO, {args.prompts} prompts x {args.n} samples, "
            f"{args.max_new_tokens} new tokens, micro-batch {args.rl_micro_batch_size}, {args.rl_steps} "
            f"steps ({args.rl_warmup} warm-up). Router loss coefficient {AUX} on the `+aux` sides."
            + (f" Every side with `{args.flags}`." if args.flags else ""), ""]
    return "\n".join(head + sections)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=None, help="build_tiny presets, comma-separated (default small,base; "
                   "--quick: nano,small)")
    p.add_argument("--only", choices=["sft", "rl", "blocks"], default=None, help="run one of the three parts")
    p.add_argument("--block-tokens", type=int, default=512, help="rows of the MLP block micro-benchmark")
    p.add_argument("--block-rounds", type=int, default=20, help="interleaved rounds of the MLP block "
                                                                "benchmark")
    p.add_argument("--repeats", type=int, default=2, help="round-robin runs per task and size")
    p.add_argument("--sft-steps", type=int, default=8, help="SFT optimizer steps per run (the first is "
                                                            "warm-up)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--rl-steps", type=int, default=4, help="GRPO steps per run")
    p.add_argument("--rl-warmup", type=int, default=1, help="first GRPO steps left out of the timing")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rl-micro-batch-size", type=int, default=16)
    p.add_argument("--rl-sides", default="dense,moe+aux", help="comma-separated of " + ", ".join(RL_SIDES))
    p.add_argument("--flags", default=None, help="extra posttrain flags for every side, e.g. "
                   "--flags=--ds.no_onednn_linear (posttrain's oneDNN path speeds the dense model's "
                   "nn.Linear layers, not the experts' 3-D weights)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: sizes nano,small, 2 steps each (1 warm-up), 1 repeat, at most 5 s "
                        "waiting")
    add_round_robin_args(p, ["sft", "rl"])
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.set_defaults(threads=1, chunk=2)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.quick:
        args.sizes, args.sft_steps, args.rl_steps, args.rl_warmup = args.sizes or "nano,small", 2, 2, 1
        args.repeats, args.max_wait, args.block_rounds = 1, min(args.max_wait, 5.0), min(args.block_rounds, 5)
    args.sizes = args.sizes or "small,base"
    if args.sft_steps < 2 or args.rl_steps < args.rl_warmup + 1 or args.rl_warmup < 1:
        p.error("need --sft-steps >= 2, --rl-warmup >= 1 and --rl-steps > --rl-warmup")
    if (args.prompts * args.n) % args.rl_micro_batch_size or args.batch_size % args.micro_batch_size:
        p.error("batches must be whole micro-batches")

    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_moe_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir {work}", flush=True)
    sections, summary = [], []
    for size in args.sizes.split(","):
        models = build_models(work, size)
        if args.only in (None, "sft"):
            spec = sft_spec(args, work, models)
            runs = run_task(args, work, "sft", size, spec, list(SFT_SIDES))
            sections += [f"SFT step, {size}:", "", sft_table(size, models, runs, spec), ""]
            summary += [f"- SFT {size}: " + ratio_text(runs, side, "dense", 1) for side in ("moe", "moe+aux")]
        if args.only in (None, "rl"):
            spec = rl_spec(args, work, models)
            sides = args.rl_sides.split(",")
            runs = run_task(args, work, "rl", size, spec, sides)
            sections += [f"GRPO step (one process), {size}:", "", rl_table(size, models, runs, spec), ""]
            summary += [f"- RL {size}: " + ratio_text(runs, side, "dense", spec["warmup"]) for side in sides
                        if side != "dense"]
        if args.only in (None, "blocks"):
            import torch
            from transformers import AutoConfig

            torch.set_num_threads(args.threads or torch.get_num_threads())
            blocks = block_times(models, args.block_tokens, args.block_rounds)
            optim = optimizer_times(models, args.block_rounds)
            layers = AutoConfig.from_pretrained(models["dense"]["path"]).num_hidden_layers
            sections += [f"Components, {size}: one layer's MLP block, forward + backward of "
                         f"{args.block_tokens} tokens (random hidden states), and one optimizer step over "
                         f"the whole model; median CPU time of {args.block_rounds} interleaved rounds, one "
                         f"thread:", "", block_table(size, blocks, optim, layers), ""]
    sections += ((["MoE / dense:", "", *summary, ""] if summary else [])
                 + [f"Total wall time {time.perf_counter() - t0:.0f} s.", ""])
    text = report(args, started, sections)
    print("\n" + text, flush=True)
    if args.markdown:
        Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
