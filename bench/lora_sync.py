"""Adapter-only weight sync with LoRA: what travels per sync, and what each HF-engine mode costs.

1. Bytes (exact arithmetic, no weights in memory): the Qwen2-0.5B shape (hidden 896, 24 layers, 14/2 heads,
   intermediate 4864, vocabulary 151936, tied embeddings) built on the meta device, LoRA rank 8 on all linear
   layers through `posttrain.models.apply_lora`; adapter bytes (`lora_sync.adapter_bytes`) against the full
   weights, both in bf16.
2. HF engine (`--vllm.lora_sync merged|adapter`) on a tiny preset on CPU: seconds per adapter sync
   (`sync_weights` from a peft policy) and decode tokens/s of each mode, next to a plain engine without LoRA.

    python bench/lora_sync.py [--size small] [--prompts 8] [--new-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from posttrain.models import LoraSpec, apply_lora, build_tiny, load_causal_lm, load_tokenizer  # noqa: E402
from posttrain.models import lora_sync as ls  # noqa: E402
from posttrain.rollout import HFRolloutEngine, SamplingParams  # noqa: E402

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, torch_dtype="bfloat16")


def bytes_at_half_billion(rank: int) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).to(torch.bfloat16)
        full = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
        peft = apply_lora(model, LoraSpec(rank=rank, alpha=2 * rank)).to(torch.bfloat16)
    adapter = ls.adapter_bytes(peft)
    return dict(params=full // 2, full_bytes=full, adapter_bytes=adapter, ratio=adapter / full,
                tensors=len(ls.adapter_pairs(peft)))


def engine_modes(size: str, rank: int, prompts: int, new_tokens: int, repeats: int) -> list[dict]:
    folder = Path(tempfile.mkdtemp()) / size
    build_tiny(folder, arch="llama", size=size, seed=0, verbose=False)
    tok = load_tokenizer(str(folder))
    torch.manual_seed(0)
    policy = apply_lora(load_causal_lm(str(folder), dtype="fp32"), LoraSpec(rank=rank, alpha=2 * rank)).eval()
    with torch.no_grad():
        for p in ls.adapter_params(policy).values():
            p.normal_(0, 0.02)
    batch = [[5 + i, 17, 300 + i, 42, 9] for i in range(prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=1, stop_token_ids=[])
    rows = []
    for mode in ("none", "merged", "adapter"):
        lora = None if mode == "none" else LoraSpec(rank=rank, alpha=2 * rank)
        engine = HFRolloutEngine(load_causal_lm(str(folder), dtype="fp32").eval(), tok,
                                 pad_token_id=tok.pad_token_id, lora=lora,
                                 lora_sync=mode if lora else "merged")
        if lora:
            engine.load_weights(policy)  # the first sync: base + adapter
            sync = []
            for _ in range(repeats):
                start = time.perf_counter()
                sent = engine.sync_weights(policy)
                sync.append(time.perf_counter() - start)
        else:
            sent, sync = (sum(t.numel() * t.element_size() for t in engine.model.state_dict().values()),
                          [float("nan")])
        engine.generate(batch[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = engine.generate(batch, params)
            best = min(best, time.perf_counter() - start)
        tokens = sum(len(o.output_token_ids) for g in out for o in g)
        rows.append(dict(mode=mode, bytes=sent, sync_s=min(sync), tok_s=tokens / best,
                         fast=engine._fast is not None and engine._fast.usable()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--size", default="small", help="tiny-model preset for the engine timings")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    b = bytes_at_half_billion(args.rank)
    print(f"Qwen2-0.5B shape, {b['params'] / 1e6:.1f} M parameters, LoRA rank {args.rank} all-linear "
          f"({b['tensors']} tensors), bf16:")
    print(f"  full weights {b['full_bytes'] / 2**20:.1f} MiB, adapter {b['adapter_bytes'] / 2**20:.2f} MiB, "
          f"ratio {100 * b['ratio']:.3f}%")
    print(f"\nHF engine, llama '{args.size}' fp32, {torch.get_num_threads()} threads, {args.prompts} prompts "
          f"x {args.new_tokens} new tokens, best of {args.repeats}:")
    print("| mode | bytes per sync | sync s | decode tokens/s | fast decode |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in engine_modes(args.size, args.rank, args.prompts, args.new_tokens, args.repeats):
        sync = "-" if r["sync_s"] != r["sync_s"] else f"{r['sync_s']:.4f}"
        label = "no LoRA (full state)" if r["mode"] == "none" else r["mode"]
        print(f"| {label} | {r['bytes']:,} | {sync} | {r['tok_s']:.0f} | {'yes' if r['fast'] else 'no'} |")


if __name__ == "__main__":
    main()
