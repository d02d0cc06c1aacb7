"""Peak memory of one RL training step with and without gradient checkpointing, actor and critic.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rl_memory.py [--size small] [--lengths 512 2048] [--rows 1]

One random-init `build_tiny` model (llama, fp32, sdpa) is the actor (`roles.Actor`, loaded as the
policy) and the critic (`roles.Critic`, the same folder with a new score head, as PPO starts a critic
from the policy), each loaded with and without `gradient_checkpointing` (what
`--actor.gradient_checkpointing_enable` passes to both). For each response length, `--rows` samples
of a 16-token prompt plus that many response tokens (random ids, random advantages / returns) take
one `fit` (forward and backward of one optimizer step; the optimizer update is replaced by zeroing
the gradients in place, so neither its temporaries nor newly allocated gradients hide the
activations) after one unmeasured warm-up `fit`, which leaves the gradient tensors allocated. The
activation peak is the most tensor memory the measured step held above what was held before it
(weights and gradients), from `posttrain.utils.memory.peak_memory` (the profiler's allocation events
on CPU, the allocator's peak on CUDA): the saved activations, the logits and the backward's
temporaries. "step s" is the wall time of the warm-up step (no profiler): what the recomputation
costs. Not a test: nothing asserts.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, versions  # noqa: E402

from posttrain.config.sections import AdamConfig, OptimizerFields  # noqa: E402
from posttrain.engines import make_train_engine  # noqa: E402
from posttrain.models import build_tiny, load_causal_lm, load_score_model  # noqa: E402
from posttrain.rollout.single_turn import Rollout  # noqa: E402
from posttrain.trainers.rl.batch_forward import Batching  # noqa: E402
from posttrain.trainers.rl.experience import build_experience  # noqa: E402
from posttrain.trainers.rl.roles import Actor, Critic  # noqa: E402
from posttrain.trainers.rl.updates import UpdateSettings  # noqa: E402
from posttrain.utils.memory import peak_memory, process_peak_rss  # noqa: E402

MB = 2**20


def experience(rows: int, length: int, pad_id: int):
    g = torch.Generator().manual_seed(0)
    rolls = [Rollout(torch.randint(3, 1000, (16,), generator=g).tolist(),
                     torch.randint(3, 1000, (length,), generator=g).tolist(), [-1.0] * length, "length", "",
                     "")
             for _ in range(rows)]
    exp = build_experience(rolls, torch.zeros(rows), pad_id)
    for name in ("advantages", "values", "returns"):
        setattr(exp, name, torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask)
    return exp


def settings(rows: int, length: int) -> UpdateSettings:
    return UpdateSettings(batch_size=rows, batching=Batching(rows), max_epochs=1, loss_agg="token_mean",
                          max_len=length, eps_low=0.2, eps_high=0.2, dual_clip=None, policy_loss_type="ppo",
                          entropy_coef=None, kl_use_loss=False, kl_estimator="k1", is_correction=None,
                          is_threshold=(0.5, 5.0), value_clip=None, seed=0)


def role(kind: str, path: str, checkpointing: bool):
    device = torch.device("cpu")
    if kind == "actor":
        model = load_causal_lm(path, gradient_checkpointing=checkpointing).train()
        engine = make_train_engine(model, OptimizerFields(adam=AdamConfig(lr=1e-5)), total_steps=4)
        return Actor(model, engine, 1.0, device)
    model = load_score_model(path, gradient_checkpointing=checkpointing, new_head_ok=True).train()
    engine = make_train_engine(model, OptimizerFields(adam=AdamConfig(lr=1e-5)), total_steps=4)
    return Critic(model, engine, device)


def measure(kind: str, path: str, checkpointing: bool, exp, s: UpdateSettings) -> tuple[float, float]:
    """(activation peak MiB, warm-up step seconds) of one fit."""
    r = role(kind, path, checkpointing)
    r.engine.step = lambda: r.model.zero_grad(set_to_none=False) or 0.0
    fit = (lambda: r.fit(exp, s, 0.0, step=0)) if kind == "actor" else (lambda: r.fit(exp, s, step=0))
    start = time.perf_counter()
    fit()
    seconds = time.perf_counter() - start
    _, peak = peak_memory(fit)
    return peak.peak_bytes / MB, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"versions: {versions()}\nmachine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        summary = build_tiny(Path(tmp) / "m", arch="llama", size=args.size, verbose=False)
        print(f"model: build_tiny llama/{args.size}, {summary['num_parameters']:,} parameters, fp32; "
              f"{args.rows} row(s) of 16 prompt tokens + the response")
        print("| role | response tokens | activation peak MiB, no checkpointing | with checkpointing | ratio "
              "| step s, no checkpointing | with checkpointing |")
        print("|---|---|---|---|---|---|---|")
        for kind in ("actor", "critic"):
            for length in args.lengths:
                exp, s = experience(args.rows, length, summary["pad_token_id"]), settings(args.rows, length)
                plain, t0 = measure(kind, summary["path"], False, exp, s)
                ckpt, t1 = measure(kind, summary["path"], True, exp, s)
                print(f"| {kind} | {length} | {plain:.1f} | {ckpt:.1f} | {ckpt / plain:.2f} | {t0:.2f} | "
                      f"{t1:.2f} |", flush=True)
    print(f"process peak RSS (whole run): {process_peak_rss() / MB:.0f} MiB")


if __name__ == "__main__":
    main()
