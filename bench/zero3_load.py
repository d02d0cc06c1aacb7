"""Resident memory per rank while a model loads and its engine is built: one process loading the
whole model, 2 ranks loading it whole and then partitioning it in a ZeRO-3 engine (what a ZeRO-3 run
did before `engines.zero3.sharded_loading`), and 2 ranks loading it straight into ZeRO-3 shards
(gloo on CPU, fp32).

    python bench/zero3_load.py MODEL_DIR [MODEL_DIR ...]      # e.g. folders of `posttrain init-tiny`

Each case runs in fresh processes; each rank records its RSS before loading (torch, transformers and
DeepSpeed imported, the process group started: the baseline), its peak (`ru_maxrss`) and RSS after
loading, the same after the engine (`FrozenShards`; one process instead reads every weight once), and
the parameters it holds. glibc keeps freed large buffers in the heap after its mmap threshold grows;
`MALLOC_MMAP_THRESHOLD_=131072` in the environment fixes the threshold (bench/RESULTS.md has both).
A benchmark, not a test: nothing is asserted."""
from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def worker(model_dir: str, case: str, out_dir: str) -> None:
    """`case`: "whole" (one process; every weight is then read once, so that the lazily mapped
    safetensors pages are resident, as they are after the first step), "whole-zero3" (2 ranks: loaded
    whole, then partitioned by the ZeRO-3 engine: this change's "before") or "sharded-zero3" (2 ranks:
    loaded straight into shards, then the same engine)."""
    import deepspeed  # noqa: F401  (imported before the baseline, as in a DeepSpeed run)
    import torch
    import transformers  # noqa: F401

    from posttrain.config.sections import DSConfig
    from posttrain.engines.zero3 import FrozenShards, shard_numel, sharded_loading, start_process_group
    from posttrain.models import load_causal_lm

    ds = DSConfig(param_dtype="fp32")
    if case != "whole":
        start_process_group()
    base_rss = _rss_mb()
    with sharded_loading(ds, 3 if case == "sharded-zero3" else None) as active:
        model = load_causal_lm(model_dir, dtype="fp32")
    loaded_peak, loaded_rss = _peak_mb(), _rss_mb()
    own, full = shard_numel(model)
    if case == "whole":
        with torch.no_grad():
            for p in model.parameters():
                p.sum()
    else:
        engine = FrozenShards(model, ds)
        own = shard_numel(engine.module)[0]
    rank = int(os.environ.get("RANK", "0"))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "sharded_load": active, "baseline_rss_mb": base_rss, "loaded_peak_mb": loaded_peak,
        "loaded_rss_mb": loaded_rss, "peak_mb": _peak_mb(), "rss_mb": _rss_mb(), "own_params": own,
        "full_params": full}))
    if case != "whole":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def run_case(model_dir: str, case: str) -> list[dict]:
    nproc = 1 if case == "whole" else 2
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(REPO)}
    out_dir = tempfile.mkdtemp(prefix="zero3_load")
    script = [str(Path(__file__).resolve()), "--worker", model_dir, case, out_dir]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", port, *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    results = [json.loads(f.read_text()) for f in sorted(Path(out_dir).glob("rank*.json"))]
    shutil.rmtree(out_dir)
    return sorted(results, key=lambda r: r["rank"])


CASES = {"whole": "1 process, loaded whole", "whole-zero3": "2 ranks ZeRO-3, loaded whole, then partitioned",
         "sharded-zero3": "2 ranks ZeRO-3, loaded as shards"}


def main(model_dirs: list[str]) -> None:
    print("| model | case | rank | RSS before load | peak after load | RSS after load | peak after engine "
          "| RSS after engine | params held |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model_dir in model_dirs:
        size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / 2**20
        for case, label in CASES.items():
            for r in run_case(model_dir, case):
                engine = ("(read once) " if case == "whole" else "")
                print(f"| {Path(model_dir).name} ({r['full_params'] / 1e6:.0f}M, {size:.0f} MB) | {label} | "
                      f"{r['rank']} | {r['baseline_rss_mb']:.0f} | {r['loaded_peak_mb']:.0f} | "
                      f"{r['loaded_rss_mb']:.0f} | {engine}{r['peak_mb']:.0f} | {engine}{r['rss_mb']:.0f} | "
                      f"{r['own_params'] / 1e6:.1f}M ({r['own_params'] / r['full_params']:.0%}) |",
                      flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main(sys.argv[1:])
