"""A local, seeded arithmetic task for demos and tests (SFT, reward models, DPO, verifiable RL).

Difficulty levels (operands drawn uniformly, inclusive):
  0: a + b,            a, b ∈ [0, 9]
  1: a + b,            a, b ∈ [0, 99]
  2: a + b or a − b,   a, b ∈ [0, 99], a ≥ b for subtraction (answers are never negative)
  3: a + b, a − b or a × b; ± as level 2, × with a, b ∈ [0, 12]
A row: ``prompt`` "What is 23 + 58?", ``response`` "81", ``answer`` "81", and ``messages``
[user prompt, assistant response].

``carry_slip`` models a sloppy demonstrator: in an addition whose units digits carry, it forgets the
carry with that probability, so the ``response`` (the demonstration SFT imitates) is 10 too small
("23 + 58" → "71") while ``answer`` (the label a verifiable reward checks) stays correct. SFT on such
data inherits the slips; RL with the verifiable reward can remove them.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterable

from .errors import DataError

DIFFICULTIES = {
    0: (("+", 0, 9),),
    1: (("+", 0, 99),),
    2: (("+", 0, 99), ("-", 0, 99)),
    3: (("+", 0, 99), ("-", 0, 99), ("*", 0, 12)),
}
_SYMBOL = {"+": "+", "-": "-", "*": "*"}


def _problem(rng: random.Random, difficulty: int) -> tuple[str, int, int]:
    if difficulty not in DIFFICULTIES:
        raise DataError(f"difficulty: must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}.")
    op, lo, hi = rng.choice(DIFFICULTIES[difficulty])
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if op == "-" and a < b:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    slipped = value - 10 if op == "+" and a % 10 + b % 10 >= 10 else value  # the carry forgotten
    return f"What is {a} {_SYMBOL[op]} {b}?", value, slipped


def make_arithmetic_rows(n: int, seed: int = 0, difficulty: int = 0, carry_slip: float = 0.0) -> list[dict]:
    """``n`` problems, a pure function of the arguments; keys prompt/messages/response/answer.
    With ``carry_slip`` p > 0, the response of a carrying addition is the slipped one with
    probability p (the answer stays correct); the problems are the same whatever p."""
    if not 0.0 <= carry_slip <= 1.0:
        raise DataError(f"carry_slip: must be a probability in [0, 1], got {carry_slip!r}.")
    rng = random.Random(f"arith-{seed}-{difficulty}")
    slip_rng = random.Random(f"slip-{seed}-{difficulty}")
    rows = []
    for _ in range(n):
        prompt, value, slipped = _problem(rng, difficulty)
        answer = str(value)
        response = str(slipped) if slipped != value and slip_rng.random() < carry_slip else answer
        rows.append(
            {
                "prompt": prompt,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                "response": response,
                "answer": answer,
            }
        )
    return rows


def make_preference_rows(n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
    """``n`` preference pairs: ``prompt``, ``chosen`` (the correct answer), ``rejected`` (a wrong
    answer: correct ± 1..5, never negative), ``answer``, and ``chosen_messages`` /
    ``rejected_messages`` (full conversations, for chat-template RM/DPO data)."""
    rng = random.Random(f"pref-{seed}-{difficulty}")
    rows = []
    for row in make_arithmetic_rows(n, seed, difficulty):
        value = int(row["answer"])
        offset = rng.randint(1, 5)
        wrong = value + offset if value - offset < 0 or rng.random() < 0.5 else value - offset
        user = {"role": "user", "content": row["prompt"]}
        rows.append(
            {
                "prompt": row["prompt"],
                "chosen": row["answer"],
                "rejected": str(wrong),
                "answer": row["answer"],
                "chosen_messages": [user, {"role": "assistant", "content": row["answer"]}],
                "rejected_messages": [user, {"role": "assistant", "content": str(wrong)}],
            }
        )
    return rows


def write_jsonl(rows: Iterable[dict], path: str) -> str:
    """Write rows as JSON lines (dropping the loader's ``__source__``/``__row__``); returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            clean = {k: v for k, v in row.items() if k not in ("__source__", "__row__")}
            f.write(json.dumps(clean, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


_INT = re.compile(r"-?\d+")


def extract_answer(text: str) -> str | None:
    """The last integer in ``text`` as a canonical string ("081" → "81", "-0" → "0"), or None."""
    found = _INT.findall(text or "")
    return str(int(found[-1])) if found else None


def is_correct(response_text: str, answer: str | int) -> bool:
    """True when the last integer of the response equals the label (compared as integers)."""
    got = extract_answer(response_text)
    want = extract_answer(str(answer))
    return got is not None and got == want
