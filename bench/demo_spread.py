"""How far `make demo`'s numbers move with the seed: the demo over several seeds, one table of each
stage's range. A benchmark of the recipe, not a test.

    .venv/bin/python bench/demo_spread.py --seeds 42,1,2 [--agent-only | --arithmetic-only]
        [--recipes 640:3e-4,1280:3e-4]
        [--flags "--ds.no_onednn_linear"] [--workdir runs/spread]

Without `--agent-only` or `--arithmetic-only`, each seed is one `posttrain demo --seed S` (its
summary.json read back). With `--arithmetic-only`, only the arithmetic rows (the base model, SFT, DPO,
the reward model, PPO with it, GRPO: `demo.run_arithmetic_task` on the FULL recipe). With `--agent-only`,
only the calculator task runs: per seed the base model and the agent SFT once (reused from an earlier
sweep in the same --workdir), then multi-turn RL for each
`--recipes` entry (RL prompts:learning rate) from that SFT model; with `--control` also the
single-turn control (its RL without the tool; `--recipes ""` runs only the SFT and the control).
`--flags` are appended to every training launch of the agent-only sweep (a rounding variant, e.g.
`--ds.no_onednn_linear`); `POSTTRAIN_CPU_KERNELS=0` in the environment is another.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from dataclasses import replace
from pathlib import Path


def full_demo(seed: int, out: Path) -> dict[str, float]:
    from posttrain.cli import demo

    summary = demo.main(["--seed", str(seed), "--output", str(out)])
    row = {k: v for k, v in summary["accuracy"].items() if k != "base (random init)"}
    row["reward model (preference acc.)"] = summary["rm_preference_accuracy"]
    row.update({f"calculator: {k}": v for k, v in summary["agent_success"].items()})
    return row


def arithmetic_only(seed: int, out: Path) -> dict[str, float]:
    from posttrain.cli import demo

    result = demo.run_arithmetic_task(demo.FULL, out / "base", out, seed, lambda _stage, fn, *a: fn(*a))
    return {**result["accuracy"], "reward model (preference acc.)": result["rm_preference_accuracy"]}


def agent_only(seed: int, out: Path, recipes: list[tuple[int, float]], flags: list[str],
               control: bool = False) -> dict[str, float]:
    from posttrain.agents.examples import CALCULATOR_AGENT, CALCULATOR_NO_TOOL
    from posttrain.cli import demo, train_ppo_ray, train_sft
    from posttrain.models import build_tiny
    from posttrain.trainers.task_eval import agent_success

    scale = demo.FULL
    base = out / "base"
    if not (base / "config.json").exists():
        build_tiny(str(base), arch="llama", size=scale.size, head="lm", seed=seed, overwrite=True)
    test = demo.agent_data(scale, out, seed)
    data, sft = out / "data" / "agent", out / "agent_sft"
    if not (sft / "config.json").exists():  # an earlier sweep's SFT model of this seed is reused
        train_sft.main(demo.agent_sft_flags(scale, base, data, sft, seed) + flags)
    row = {"after SFT": agent_success(sft, test, CALCULATOR_AGENT)[0]}
    for prompts, lr in recipes:
        rl = out / f"agent_rl_{prompts}_{lr:g}"
        recipe = replace(scale, agent_prompts=prompts, agent_rl_lr=lr)
        train_ppo_ray.main(demo.agent_rl_flags(recipe, sft, data, rl, seed, CALCULATOR_AGENT) + flags)
        row[f"RL {prompts} prompts, lr {lr:g}"] = agent_success(rl, test, CALCULATOR_AGENT)[0]
    if control:  # the demo's single-turn control: its RL recipe without the tool
        single = out / "agent_single_turn"
        train_ppo_ray.main(demo.agent_rl_flags(scale, sft, data, single, seed, CALCULATOR_NO_TOOL) + flags)
        row["single-turn control"] = agent_success(single, test, CALCULATOR_NO_TOOL)[0]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="42,1,2")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--agent-only", action="store_true")
    only.add_argument("--arithmetic-only", action="store_true")
    ap.add_argument("--recipes", default="640:3e-4", help="agent RL prompts:lr, comma-separated "
                                                          "(--agent-only)")
    ap.add_argument("--control", action="store_true", help="also the single-turn control (--agent-only)")
    ap.add_argument("--flags", default="", help="extra training flags for the agent-only sweep")
    ap.add_argument("--workdir", default="runs/spread")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    recipes = [(int(p), float(lr)) for p, lr in (r.split(":") for r in args.recipes.split(",") if r)]
    rows: dict[int, dict[str, float]] = {}
    for seed in seeds:
        start = time.time()
        out = Path(args.workdir) / f"seed{seed}"
        rows[seed] = (agent_only(seed, out, recipes, shlex.split(args.flags), args.control) if args.agent_only
                      else arithmetic_only(seed, out) if args.arithmetic_only else full_demo(seed, out))
        print(f"seed {seed} ({(time.time() - start) / 60:.1f} min): {json.dumps(rows[seed])}", flush=True)
    print(f"\n| stage | {' | '.join(f'seed {s}' for s in seeds)} | range | spread |")
    print(f"|---|{'---|' * len(seeds)}---|---|")
    for stage in rows[seeds[0]]:
        values = [rows[s][stage] * 100 for s in seeds]
        print(f"| {stage} | {' | '.join(f'{v:.1f}' for v in values)} | {min(values):.1f}-{max(values):.1f} | "
              f"{max(values) - min(values):.1f} (sd {statistics.pstdev(values):.1f}) |")


if __name__ == "__main__":
    main()
