"""Math answer helpers for reward functions (the `openrlhf.utils` math API, same signatures).

`extract_boxed_answer(text) -> str | None`: the contents of the LAST `\\boxed{...}` (or `\\fbox{...}`)
in `text`, nested braces kept (`\\boxed{\\sqrt{x^{2}}}` -> `\\sqrt{x^{2}}`); None when there is no box
or the last one is never closed (a truncated answer).

`grade_answer(given_answer, ground_truth) -> bool`: True when the already extracted answer equals the
ground truth mathematically: `0.5` = `\\frac{1}{2}`, `2` = `2.0`, `x+1` = `1+x`, `1,000` = `1000`,
`x=3` = `3`, sets and intervals compared as such. Non-strings are compared through `str()`; None on
either side -> False; unparsable input -> False (never raises). Equivalence is decided by
math-verify (LaTeX -> SymPy), after a cheap normalised-string comparison.

Time limits: math-verify bounds each parse / comparison with SIGALRM, which only works in the main
thread; elsewhere (posttrain runs `reward_func` in a worker thread, under `--reward.timeout`) a
comparison runs without its own limit and the reward call's timeout is the bound.
"""
from __future__ import annotations

import logging
import re
import threading

from posttrain.utils.extras import require

__all__ = ["extract_boxed_answer", "grade_answer"]

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_SECONDS = 5  # math-verify's per-parse / per-comparison limit, main thread only
_TEXT = re.compile(r"^\\(?:text|textbf|mathrm)\{(.*)\}$")


def extract_boxed_answer(solution: str) -> str | None:
    """Contents of the last `\\boxed{...}` / `\\fbox{...}` of `solution` (module doc)."""
    if not isinstance(solution, str):
        return None
    last = None
    for last in _BOX.finditer(solution):
        pass
    if last is None:
        return None
    depth = 1
    for i in range(last.end(), len(solution)):
        ch = solution[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return solution[last.end():i]
    return None


def _plain(answer: str) -> str:
    """Cheap normal form for the string comparison: no spaces, `$`, `\\left`/`\\right`, `\\!`, trailing
    dot or `\\text{}` wrapper; `\\dfrac`/`\\tfrac` -> `\\frac`."""
    s = answer.strip().strip("$").strip()
    m = _TEXT.match(s)
    if m:
        s = m.group(1)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), (" ", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac")):
        s = s.replace(old, new)
    return s.rstrip(".")


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns once that a call without a time limit must be bounded by the caller; posttrain
    bounds it (`--reward.timeout`), so that line is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_filtered = False


def _math_verify():
    global _filtered
    require("the math grader (grade_answer)", "math_verify")
    import math_verify

    if not _filtered:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_NoTimeoutWarning())
        _filtered = True
    return math_verify


def grade_answer(given_answer: str, ground_truth: str) -> bool:
    """Whether `given_answer` (already extracted, e.g. by `extract_boxed_answer`) is mathematically
    equal to `ground_truth` (module doc)."""
    if given_answer is None or ground_truth is None:
        return False
    given, truth = str(given_answer).strip(), str(ground_truth).strip()
    if not given or not truth:
        return False
    if _plain(given) == _plain(truth):
        return True
    mv = _math_verify()
    from math_verify.errors import TimeoutException  # a BaseException

    seconds = _SECONDS if threading.current_thread() is threading.main_thread() else None
    try:
        gold = mv.parse(f"${truth}$", parsing_timeout=seconds)
        pred = mv.parse(f"${given}$", parsing_timeout=seconds)
        if not gold or not pred:
            return False
        return bool(mv.verify(gold, pred, timeout_seconds=seconds))
    except (Exception, TimeoutException):  # math-verify's own time limit or a parser bug: not a match
        return False
