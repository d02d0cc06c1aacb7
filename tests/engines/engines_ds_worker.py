"""Worker launched by torchrun from the engine tests: DeepSpeed ZeRO stages on the shared PLAN.

Usage: torchrun --nproc_per_node 2 engines_ds_worker.py OUT.pt STATE_DIR STAGE[,STAGE...] [RESUME_STAGE,...]
STAGE is a ZeRO stage 0-3, or -1 for the data-parallel TorchEngine.
Writes (rank 0) {stage: {"w": [weights after each step], "norms", "lrs", "resumed_w": [...]}}.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from engines_common import OPT, PLAN, make_data, run_step, tiny_llama, torch_engine, train_engine, weights

from posttrain.engines.dist import shutdown


def build(stage, seed):
    if stage < 0:
        return torch_engine(tiny_llama(seed), **OPT)
    return train_engine(tiny_llama(seed), zero_stage=stage, **OPT)


def main():
    out, state_dir, stages = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    resume = [int(s) for s in sys.argv[4].split(",")] if len(sys.argv) > 4 and sys.argv[4] else []
    data = make_data()
    results = {}
    for stage in stages:
        engine = build(stage, 0)
        rank = engine.rank
        res = {"w": [], "norms": [], "lrs": []}
        for s, plan in enumerate(PLAN):
            res["lrs"].append(engine.lr)
            # ZeRO-0/1 reduce only in step(): ranks may run different numbers of micro-batches unpadded.
            res["norms"].append(run_step(engine, data, plan, rank, pad=stage >= 2))
            res["w"].append(weights(engine))
            if s == 0 and stage in resume:
                engine.save_state(os.path.join(state_dir, f"stage{stage}"))
        if stage in resume:
            fresh = build(stage, 123)
            try:
                fresh.load_state(os.path.join(state_dir, "does-not-exist"))
            except FileNotFoundError as e:
                res["missing_error"] = str(e)
            fresh.load_state(os.path.join(state_dir, f"stage{stage}"))
            res["resumed_step"] = fresh.global_step
            res["resumed_w"] = []
            for plan in PLAN[1:]:
                run_step(fresh, data, plan, rank, pad=True)
                res["resumed_w"].append(weights(fresh))
        results[stage] = res
    if rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
    shutdown()  # no gloo thread left alive at exit (an exit-time abort otherwise)
