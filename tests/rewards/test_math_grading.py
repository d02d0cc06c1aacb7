"""extract_boxed_answer / grade_answer: OpenRLHF's `openrlhf.utils` math API, graded by math-verify."""
import threading

import pytest

from posttrain.rewards.math_grading import extract_boxed_answer, grade_answer


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{\\sqrt{x^{2}}}", "\\sqrt{x^{2}}"),  # nested braces kept
    ("first \\boxed{3}, then \\boxed{4}, finally \\boxed{\\{1,2\\}} done", "\\{1,2\\}"),  # the last box
    ("no box here, the answer is 5", None),
    ("\\boxed{1} and a truncated \\boxed{2", None),  # the last box never closes
    ("\\fbox{7}", "7"),
    ("\\boxed {8}", "8"),
    ("", None),
])
def test_extract_boxed_answer(text, expected):
    assert extract_boxed_answer(text) == expected


@pytest.mark.parametrize("given, truth", [
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{3}{4}", "0.75"),
    ("2", "2.0"),
    ("2.0", 2),  # non-string label
    ("x+1", "1+x"),
    ("\\sqrt{x^{2}}", "\\sqrt{x^2}"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("1,000", "1000"),
    ("x=3", "3"),
    ("\\text{Monday}", "Monday"),
    ("(1,2)", "(1, 2)"),
])
def test_equivalent_answers_grade_true(given, truth):
    assert grade_answer(given, truth) is True


@pytest.mark.parametrize("given, truth", [
    ("3", "4"),
    ("-3", "3"),
    ("x+2", "x+1"),
    ("\\frac{1}{3}", "0.5"),
    ("0.333", "\\frac{1}{3}"),
    ("(2,1)", "(1,2)"),
    ("B", "A"),
    ("", "1"),
    (None, "1"),
    ("1", None),
    ("\\frac{1}{", "1"),  # unparsable: False, never raises
])
def test_wrong_answers_grade_false(given, truth):
    assert grade_answer(given, truth) is False


def test_grading_works_off_the_main_thread():
    """posttrain runs reward_func in a worker thread, where math-verify's SIGALRM limit is unusable."""
    out = []
    worker = threading.Thread(target=lambda: out.extend([grade_answer("\\frac{1}{2}", "0.5"),
                                                         grade_answer("x+1", "x+2")]))
    worker.start()
    worker.join(30)
    assert out == [True, False]


@pytest.mark.parametrize("given, truth, same", [
    ("[1,2]", "[1,2]", True),
    ("[1,2)", "[1, 2)", True),
    ("[1,2]", "\\left[1,2\\right]", True),
    ("[0.5,2]", "[\\frac{1}{2},2]", True),  # the ends compared as numbers
    ("[1,2]", "[1,2)", False),  # the docs' example: the closed end matters
    ("[1,2)", "[1,2]", False),
    ("(1,2)", "[1,2]", False),
    ("(1,2]", "[1,2)", False),
    ("(1,2)", "(1,2]", False),
    ("(-\\infty,1)", "(-\\infty,1]", False),
    ("[1,2]\\cup[3,4]", "[1,2]\\cup[3,4)", False),
])
def test_intervals_are_compared_with_their_ends(given, truth, same):
    """docs/rewards.md: `[1,2]` ≠ `[1,2)`; an interval equals another only with the same ends and the
    same open / closed ends, whichever side is the label."""
    assert grade_answer(given, truth) is same
    assert grade_answer(truth, given) is same


@pytest.mark.parametrize("given, truth", [("\\{1,2\\}", "\\{2,1\\}"), ("0.05", "5\\%")])
def test_the_docs_set_and_percent_examples(given, truth):
    """docs/rewards.md: `\\{1,2\\}` = `\\{2,1\\}` (sets, any order), `0.05` = `5\\%`."""
    assert grade_answer(given, truth) is True and grade_answer(truth, given) is True
