"""Linear layers on CPU: torch's `F.linear` (MKL) against oneDNN (`models/cpu_linear.py`), per preset shape
and direction. Prints, for each (preset, layer, rows), the time of the forward, ∂x and ∂W of both paths and
their ratio (oneDNN / torch: below 1 means oneDNN is faster). A benchmark, not a test.

    .venv/bin/python bench/linear_paths.py [--threads 2] [--rows 16,256,1024,4096]
"""
from __future__ import annotations

import argparse
import time

import torch

from posttrain.models.cpu_linear import _matmul, packed_linear, packed_weight
from posttrain.models.tiny import PRESETS


def layer_shapes(preset) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of a llama of this preset (2k vocabulary)."""
    h, i = preset.hidden_size, preset.intermediate_size
    kv = h // preset.num_attention_heads * preset.num_key_value_heads
    return {"q/o": (h, h), "k/v": (h, kv), "gate/up": (h, i), "down": (i, h), "lm_head": (h, 2048)}


def decode_shapes(preset) -> dict[str, tuple[int, int]]:
    """(in, out) of the rollout engine's fused decode matmuls (rollout/cpu/fast_decode.py)."""
    h, i = preset.hidden_size, preset.intermediate_size
    kv = h // preset.num_attention_heads * preset.num_key_value_heads
    return {"q|k|v": (h, h + 2 * kv), "o": (h, h), "gate|up": (h, 2 * i), "down": (i, h),
            "lm_head": (h, 2048)}


def clock(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def directions(rows: int, k: int, n: int, reps: int) -> dict[str, tuple[float, float]]:
    x, w, dy = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
    return {
        "forward": (clock(lambda: torch.nn.functional.linear(x, w), reps),
                    clock(lambda: _matmul(x, w, None), reps)),
        "dx": (clock(lambda: dy @ w, reps), clock(lambda: _matmul(dy, w.t(), None), reps)),
        "dW": (clock(lambda: dy.t() @ x, reps), clock(lambda: dy.t() @ x, reps)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="16,128,512,2048")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode-rows", default="8,32,128")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; ms per call, best of {args.reps}; ratio = "
          f"oneDNN / torch")
    print(f"{'preset':6} {'layer':8} {'rows':>5} | {'fwd torch':>9} {'oneDNN':>7} {'ratio':>5} | "
          f"{'dx torch':>8} {'oneDNN':>7} {'ratio':>5}")
    for name, preset in PRESETS.items():
        for layer, (k, n) in layer_shapes(preset).items():
            for rows in map(int, args.rows.split(",")):
                d = directions(rows, k, n, args.reps)
                (ft, fo), (dt, do) = d["forward"], d["dx"]
                print(f"{name:6} {layer:8} {rows:5d} | {ft * 1e3:9.3f} {fo * 1e3:7.3f} {fo / ft:5.2f} | "
                      f"{dt * 1e3:8.3f} {do * 1e3:7.3f} {do / dt:5.2f}", flush=True)

    print(f"\ndecode (no gradient): {'preset':6} {'matmul':8} {'rows':>5} | {'torch':>7} {'packed':>7} "
          f"{'ratio':>5}")
    for name, preset in PRESETS.items():
        for layer, (k, n) in decode_shapes(preset).items():
            for rows in map(int, args.decode_rows.split(",")):
                x, w = torch.randn(rows, k), torch.randn(n, k)
                packed = packed_weight(w, rows)
                t = clock(lambda: torch.nn.functional.linear(x, w), args.reps)
                o = clock(lambda: packed_linear(x, packed), args.reps)
                print(f"decode {name:6} {layer:8} {rows:5d} | {t * 1e3:7.3f} {o * 1e3:7.3f} {o / t:5.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
