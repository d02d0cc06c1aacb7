"""Write the example datasets in examples/data/ (committed; re-running rewrites the same bytes).

The rows come from the demo's generators (posttrain.data.synthetic, synthetic_vision): two-digit
addition, whose answers posttrain/rewards/examples/arithmetic_reward.py grades, the colour task, and
step-labelled addition chains for `posttrain prm` (placeholder "@", labels "+" / "-").
The SFT demonstrations come from the demo's sloppy demonstrator: exact sums, most of them followed by a
rounded estimate ("88, roughly 90"), whose last number the grader reads; SFT learns the sums and the
habit, and RL with the exact-match reward (or DPO on the pairs) removes the habit.
Usage, from the repository root: `python examples/make_data.py` (or `main(folder)` to write elsewhere).
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from posttrain.data.synthetic import make_arithmetic_rows, make_preference_rows, make_prm_rows, write_jsonl
from posttrain.data.synthetic_vision import COLOURS, colour_rows

OUT = Path(__file__).resolve().parent / "data"
DIFFICULTY = 1  # a + b, a in [0, 99], b in [0, 9] (the demo's task)
N_TRAIN, N_HELD = 256, 32  # rows per file; held-out prompts never appear in a training file
N_SFT = 4000  # SFT demonstrations: enough sums for the README's first SFT to learn the arithmetic
HABIT = 0.7  # share of demonstrations with the rounded tail, as the demo's demonstrator
SEED = 0


def _split(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    held = list(dict.fromkeys(r["prompt"] for r in rows))[-N_HELD:]
    test = list({r["prompt"]: r for r in rows if r["prompt"] in set(held)}.values())
    return [r for r in rows if r["prompt"] not in set(held)][:N_TRAIN], test


def _unpaired(pairs: list[dict]) -> list[dict]:
    """Pairs as KTO's unpaired rows: the chosen side desirable, the rejected side not (TRL's columns)."""
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


def main(out: Path = OUT) -> None:
    """Write every example file into `out` (emptied first)."""
    if out.exists():
        shutil.rmtree(out)
    arith, arith_test = _split(make_arithmetic_rows(2 * N_TRAIN, seed=SEED, difficulty=DIFFICULTY))
    held = {r["prompt"] for r in arith_test}
    # the same problems as `arith` first (the habit draws are separate), then more of them
    sloppy = make_arithmetic_rows(2 * N_SFT, seed=SEED, difficulty=DIFFICULTY, rounding_habit=HABIT)
    demos = [{"prompt": r["prompt"], "response": r["response"]} for r in sloppy]
    write_jsonl([r for r in demos if r["prompt"] not in held][:N_SFT], out / "sft.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in arith], out / "prompts.jsonl")
    chat = []  # two questions in one conversation: the model learns to answer each user turn
    for first, second in zip(arith[0::2], arith[1::2]):
        chat.append({"messages": first["messages"] + second["messages"]})
    write_jsonl(chat, out / "chat.jsonl")
    pairs = make_preference_rows(2 * N_TRAIN, seed=SEED + 1, difficulty=DIFFICULTY, rounding_habit=0.5)
    pairs = [p for p in pairs if p["prompt"] not in held][:N_TRAIN]
    keep = ("prompt", "chosen", "rejected")
    write_jsonl([{k: p[k] for k in keep} for p in pairs], out / "prefs.jsonl")
    held_pairs = make_preference_rows(4 * N_TRAIN, seed=SEED + 2, difficulty=DIFFICULTY, rounding_habit=0.5)
    held_pairs = list({p["prompt"]: p for p in held_pairs if p["prompt"] in held}.values())
    write_jsonl([{k: p[k] for k in keep} for p in held_pairs], out / "heldout" / "prefs.jsonl")
    for pair_rows, name in ((pairs, "unpaired.jsonl"), (held_pairs, "heldout/unpaired.jsonl")):
        write_jsonl(_unpaired(pair_rows), out / name)
    held_demos = {r["prompt"]: r for r in demos if r["prompt"] in held}  # one demonstration per prompt
    write_jsonl(list(held_demos.values()), out / "heldout" / "sft.jsonl")
    write_jsonl([{"prompt": r["prompt"], "answer": r["answer"]} for r in arith_test],
                out / "heldout" / "prompts.jsonl")
    prm = make_prm_rows(N_TRAIN + N_HELD, seed=SEED)  # a chain's text is unique enough: held out by text
    held_chains = {r["input"] for r in prm[N_TRAIN:]}
    write_jsonl([r for r in prm[:N_TRAIN] if r["input"] not in held_chains], out / "prm.jsonl")
    write_jsonl(prm[N_TRAIN:], out / "heldout" / "prm.jsonl")
    images = colour_rows(16, seed=SEED, folder=out / "images", prefix="shape-")
    rng = random.Random(SEED)  # a pair per image too: the right colour chosen over another one
    with open(out / "images.jsonl", "w") as f:
        for row in images:
            row["images"] = [f"images/{Path(p).name}" for p in row["images"]]
            row["chosen"] = row["answer"]
            row["rejected"] = rng.choice(sorted(set(COLOURS) - {row["answer"]}))
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
