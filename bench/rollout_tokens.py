"""Rollout throughput: posttrain's `HFRolloutEngine` vs transformers' `model.generate(do_sample=True)`.

    .venv/bin/python bench/rollout_tokens.py [--size tiny] [--batches 16 64] [--max-new-tokens
    32] [--repeats 3]

One tiny random-init model (`build_tiny(dir, size)`, fp32, sdpa), loaded once and shared by both
sides. The prompts are the synthetic arithmetic prompts under the tokenizer's chat template (with
the generation prompt), so their lengths differ and both sides left-pad. Both sample at
temperature 1, top_p 1, with the same stop ids (the tokenizer's eos + the generation config's)
and the same `max_new_tokens`, in one batch of the given size. `model.generate` gets the padded
batch and its attention mask; posttrain's engine gets the token-id lists and also returns
per-token log-probs (generate does not compute them here). Tokens counted = generated tokens up to
and including the first stop token of each row. Each (side, batch) is timed `--repeats` times
after one warm-up call, sides interleaved; the median is reported, both per wall-clock second
and per CPU second of the main thread (with the default ``--threads 1`` all torch work runs on the
main thread, so the CPU-time rate is robust to other processes competing for the cores).
Not a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, md_table, median, versions  # noqa: E402

from posttrain.data.synthetic import make_arithmetic_rows  # noqa: E402
from posttrain.models import build_tiny, load_causal_lm, load_tokenizer  # noqa: E402
from posttrain.rollout import HFRolloutEngine, SamplingParams  # noqa: E402


def _prompts(tokenizer, n: int) -> list[list[int]]:
    rows = make_arithmetic_rows(n, seed=0)
    return [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False) for r in rows]


def _count_until_stop(new_tokens: torch.Tensor, stop: list[int]) -> int:
    """Generated tokens per row up to and including the first stop token (the rest is padding)."""
    total = 0
    for row in new_tokens.tolist():
        hit = next((i for i, t in enumerate(row) if t in stop), None)
        total += len(row) if hit is None else hit + 1
    return total


def run_hf_generate(model, prompts, pad_id, stop, max_new, seed) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=max_new, pad_token_id=pad_id, eos_token_id=stop)
    return _count_until_stop(out[:, width:], stop)


def run_engine(engine, prompts, max_new, seed) -> int:
    out = engine.generate(prompts,
                          SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new, seed=seed))
    return sum(len(o.output_token_ids) for group in out for o in group)


def rollout_setup(description: str, argv=None, extra=()):
    """The rollout benches' flags and model (this file and rollout_async.py): (args, model info, model,
    tokenizer, posttrain's engine over the model); sets torch's thread count. `extra`: more
    (flag, argparse kwargs) pairs."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: all work on the main thread, so its CPU time is exact)")
    for flag, kwargs in extra:
        ap.add_argument(flag, **kwargs)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        info = build_tiny(Path(tmp) / "model", size=args.size, verbose=False)
        model = load_causal_lm(info["path"], dtype="fp32").eval()
        tokenizer = load_tokenizer(info["path"])
    return (args, info, model, tokenizer,
            HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id))


def main(argv=None):
    args, info, model, tokenizer, engine = rollout_setup(__doc__.splitlines()[0], argv)
    pad_id = tokenizer.pad_token_id
    stop = engine.eos_token_ids
    sides = {
        "posttrain HFRolloutEngine": lambda p, s: run_engine(engine, p, args.max_new_tokens, s),
        "transformers "
        "model.generate": lambda p, s: run_hf_generate(model, p, pad_id, stop, args.max_new_tokens, s),
    }
    print(f"# rollout tokens/s, {args.size} model ({info['num_parameters']:,} params), "
          f"max_new_tokens {args.max_new_tokens}, stop ids {stop}")
    print(f"# {machine()}")  # torch.get_num_threads() reflects --threads
    print(f"# {versions()}")
    rows = []
    for batch in args.batches:
        prompts = _prompts(tokenizer, batch)
        wall: dict[str, list[float]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {name: [] for name in sides}
        for name, fn in sides.items():
            fn(prompts, 0)  # warm-up
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                w0, c0 = time.perf_counter(), time.thread_time()
                tokens = sides[name](prompts, r + 1)
                wall[name].append(tokens / (time.perf_counter() - w0))
                cpu[name].append(tokens / (time.thread_time() - c0))
        (ours_w, theirs_w), (ours_c, theirs_c) = ([median(d[n]) for n in sides] for d in (wall, cpu))
        rows.append([str(batch), f"{ours_w:,.0f}", f"{theirs_w:,.0f}", f"{ours_w / theirs_w:.2f}x",
                     f"{ours_c:,.0f}", f"{theirs_c:,.0f}", f"{ours_c / theirs_c:.2f}x"])
    print(md_table(["batch", "ours tok/s (wall)", "generate tok/s (wall)", "ratio (wall)",
                    "ours tok/CPU-s", "generate tok/CPU-s", "ratio (CPU)"], rows))


if __name__ == "__main__":
    main()
