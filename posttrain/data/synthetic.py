"""A local, seeded arithmetic task for demos and tests (SFT, reward models, DPO, verifiable RL).

Difficulty levels (operands drawn uniformly, inclusive):
  0: a + b,            a, b ∈ [0, 9]
  1: a + b,            a ∈ [0, 99], b ∈ [0, 9]
  2: a + b,            a, b ∈ [0, 99]
  3: a + b or a − b,   a, b ∈ [0, 99], a ≥ b for subtraction (answers are never negative)
  4: a + b, a − b or a × b; ± as level 3, × with a, b ∈ [0, 12]
A row: ``prompt`` "What is 23 + 58?", ``response`` "81", ``answer`` "81", and ``messages``
[user prompt, assistant response].

``rounding_habit`` models a sloppy demonstrator: with that probability its response adds a rounded
estimate after the exact answer ("81, roughly 80"), so the last number of the demonstration, which
a grader reads as the answer, is usually wrong while ``answer`` (the label a verifiable reward
checks) stays exact. SFT imitates the habit; RL with the verifiable reward, DPO or a learned reward
model can remove it.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterable

from .errors import DataError

DIFFICULTIES = {  # (operator, a range, b range)
    0: (("+", (0, 9), (0, 9)),),
    1: (("+", (0, 99), (0, 9)),),
    2: (("+", (0, 99), (0, 99)),),
    3: (("+", (0, 99), (0, 99)), ("-", (0, 99), (0, 99))),
    4: (("+", (0, 99), (0, 99)), ("-", (0, 99), (0, 99)), ("*", (0, 12), (0, 12))),
}
_SYMBOL = {"+": "+", "-": "-", "*": "*"}


def _problem(rng: random.Random, difficulty: int) -> tuple[str, int]:
    if difficulty not in DIFFICULTIES:
        raise DataError(f"difficulty: must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}.")
    op, a_range, b_range = rng.choice(DIFFICULTIES[difficulty])
    a, b = rng.randint(*a_range), rng.randint(*b_range)
    if op == "-" and a < b:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"What is {a} {_SYMBOL[op]} {b}?", value


def rounded(value: int) -> str:
    """The habit's tail: the value rounded to tens (half up), "81" → ", roughly 80"."""
    return f", roughly {(value + 5) // 10 * 10}"


def make_arithmetic_rows(n: int, seed: int = 0, difficulty: int = 0,
                         rounding_habit: float = 0.0) -> list[dict]:
    """``n`` problems, a pure function of the arguments; keys prompt/messages/response/answer.
    With ``rounding_habit`` p > 0, each response gets the rounded tail with probability p (the
    answer stays exact); the problems are the same whatever p."""
    if not 0.0 <= rounding_habit <= 1.0:
        raise DataError(f"rounding_habit: must be a probability in [0, 1], got {rounding_habit!r}.")
    rng = random.Random(f"arith-{seed}-{difficulty}")
    habit_rng = random.Random(f"habit-{seed}-{difficulty}")
    rows = []
    for _ in range(n):
        prompt, value = _problem(rng, difficulty)
        answer = str(value)
        response = answer + rounded(value) if habit_rng.random() < rounding_habit else answer
        rows.append(
            {
                "prompt": prompt,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                "response": response,
                "answer": answer,
            }
        )
    return rows


def make_preference_rows(n: int, seed: int = 0, difficulty: int = 0,
                         rounding_habit: float = 0.0) -> list[dict]:
    """``n`` preference pairs: ``prompt``, ``chosen`` (the exact answer), ``rejected``, ``answer``, and
    ``chosen_messages`` / ``rejected_messages`` (full conversations, for chat-template RM/DPO data).
    ``rejected`` is a wrong answer (correct ± 1..5, never negative), or with probability
    ``rounding_habit`` the exact answer followed by the sloppy demonstrator's rounded tail (when that
    tail is itself wrong, i.e. the answer is not a multiple of ten)."""
    if not 0.0 <= rounding_habit <= 1.0:
        raise DataError(f"rounding_habit: must be a probability in [0, 1], got {rounding_habit!r}.")
    rng = random.Random(f"pref-{seed}-{difficulty}")
    habit_rng = random.Random(f"pref-habit-{seed}-{difficulty}")
    rows = []
    for row in make_arithmetic_rows(n, seed, difficulty):
        value = int(row["answer"])
        offset = rng.randint(1, 5)
        wrong = str(value + offset if value - offset < 0 or rng.random() < 0.5 else value - offset)
        if value % 10 and habit_rng.random() < rounding_habit:
            wrong = row["answer"] + rounded(value)
        user = {"role": "user", "content": row["prompt"]}
        rows.append(
            {
                "prompt": row["prompt"],
                "chosen": row["answer"],
                "rejected": wrong,
                "answer": row["answer"],
                "chosen_messages": [user, {"role": "assistant", "content": row["answer"]}],
                "rejected_messages": [user, {"role": "assistant", "content": wrong}],
            }
        )
    return rows


def make_prm_rows(n: int, seed: int = 0, error_rate: float = 0.5, placeholder: str = "@",
                  reward_tokens: tuple[str, str] = ("+", "-")) -> list[dict]:
    """``n`` step-labelled addition chains for a process reward model (OpenRLHF / Math-Shepherd layout), a
    pure function of the arguments: ``input`` "Q: 3+4+5?\n3+4=7 @\n7+5=12 @" (each step ends with
    `placeholder`), ``label`` one reward token per step. 2-4 single-digit terms; with probability
    `error_rate` a chain has one wrong sum (off by 1-3) at a random step, which later steps carry on from.
    As Math-Shepherd labels a step by whether the right answer is still reachable, the wrong step and every
    step after it get the bad token (``reward_tokens[1]``), the others the good one."""
    if not 0.0 <= error_rate <= 1.0:
        raise DataError(f"error_rate: must be a probability in [0, 1], got {error_rate!r}.")
    rng = random.Random(f"prm-{seed}")
    good, bad = reward_tokens
    rows = []
    for _ in range(n):
        terms = [rng.randint(1, 9) for _ in range(rng.randint(3, 5))]
        wrong_at = rng.randrange(len(terms) - 1) if rng.random() < error_rate else None
        total, steps, labels = terms[0], [], []
        for k, term in enumerate(terms[1:]):
            result = total + term
            if k == wrong_at:
                result += rng.choice((-3, -2, -1, 1, 2, 3))
            steps.append(f"{total}+{term}={result} {placeholder}")
            labels.append(bad if wrong_at is not None and k >= wrong_at else good)
            total = result
        rows.append({"input": f"Q: {'+'.join(map(str, terms))}?\n" + "\n".join(steps), "label": labels})
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
