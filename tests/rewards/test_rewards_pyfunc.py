"""PythonRewardFunction: OpenRLHF-style reward_func files load and score a whole batch in one call;
every bad file / bad return value gives an error naming the file and the problem; on_error="skip"
marks and counts the affected samples."""
import math
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.rewards import (
    PythonRewardFunction,
    RewardError,
    RewardResult,
    RewardSource,
    make_reward_source,
    parse_output,
)
from posttrain.rewards.python_func import RewardBusy

FUNCS = Path(__file__).parent / "reward_funcs"


def write(tmp_path, body, name="bad_reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_plain_reward_scores_the_batch_in_one_call():
    src = PythonRewardFunction(FUNCS / "plain_reward.py")
    assert isinstance(src, RewardSource)
    prompts = ["Q: 2+3=", "Q: 4*4=", "Q: 9-1=", "Q: 7+0="]
    responses = [" 5", " 15", " the answer is 8", " 0"]
    queries = [p + r for p, r in zip(prompts, responses)]
    out = src.score(queries, prompts, ["5", "16", "8", "7"])
    assert out.rewards.dtype == torch.float32
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]  # "7" is in the prompt, not in the response " 0"
    assert out.scores.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out.extra_logs["response_chars"].tolist() == [2.0, 3.0, 16.0, 2.0]
    assert out.skipped.tolist() == [False] * 4
    assert src.fn.__globals__["CALLS"] == [4]  # one call for the whole batch
    src.score(queries[:2], prompts[:2], ["5", "16"])
    assert src.fn.__globals__["CALLS"] == [4, 2] and src.num_calls == 2


def test_math_reward_answer_tag_boxed_and_batch_statistic():
    src = PythonRewardFunction(str(FUNCS / "math_reward.py"))
    prompts = ["What is 6*7?", "What is 1/4?", "What is 2+2?", "What is 3*3?", "What is 10-3?"]
    responses = [" Answer: 42", " so \\boxed{0.25}", " Answer: 5", " no idea", " \\boxed{1} then Answer: 7"]
    out = src.score([p + r for p, r in zip(prompts, responses)], prompts, ["42", "0.25", "4", "9", 7])
    assert out.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert out.extra_logs["math_accuracy"] == pytest.approx(0.6)  # 0-d tensor → float batch statistic
    assert src.fn.__globals__["CALLS"] == [5]


def test_readme_signature_without_kwargs_and_bare_list_return(tmp_path):
    path = write(tmp_path, """
        def reward_func(queries, prompts, labels):
            return [len(q) - len(p) for q, p in zip(queries, prompts)]
    """)
    out = PythonRewardFunction(path).score(["ab", "abcd"], ["a", "a"], None, sequences="not passed")
    assert out.rewards.tolist() == [1.0, 3.0] and out.scores.tolist() == [1.0, 3.0]


def test_kwargs_reach_functions_that_accept_them(tmp_path):
    path = write(tmp_path, """
        import numpy as np
        def reward_func(queries, prompts, labels, *, bonus=0.0):
            return {"rewards": np.array([bonus] * len(queries)), "extra_logs": {"bonus": bonus}}
    """)
    out = PythonRewardFunction(path).score(["x", "y"], ["", ""], None, bonus=0.5, other=1)
    assert out.rewards.tolist() == [0.5, 0.5] and out.extra_logs == {"bonus": 0.5}


BAD = {
    "raises": ("def reward_func(queries, prompts, labels, **kw):\n    return 1 / 0\n",
               r"bad_reward\.py raised ZeroDivisionError: division by zero \(at .*bad_reward\.py:2\)"),
    "wrong_length": ("import torch\ndef reward_func(queries, prompts, labels, **kw):\n"
                     "    return {'rewards': torch.zeros(len(queries) - 1)}\n",
                     r"bad_reward\.py: returned 3 rewards for 4 samples"),
    "nan": ("def reward_func(queries, prompts, labels, **kw):\n"
            "    return {'rewards': [0.0, 1.0, float('nan'), float('inf')]}\n",
            r"bad_reward\.py: reward 2 is NaN; reward 3 is inf"),
    "no_rewards_key": ("def reward_func(queries, prompts, labels, **kw):\n    return {'score': [0] * 4}\n",
                       r"bad_reward\.py: returned a dict without a 'rewards' key \(keys: \['score'\]\)"),
    "not_numbers": ("def reward_func(queries, prompts, labels, **kw):\n    return {'rewards': [0, 1, 'x', "
                    "2]}\n", r"bad_reward\.py: reward 2 is 'x' \(str\), not a number"),
    "bad_extra_log": ("def reward_func(queries, prompts, labels, **kw):\n"
                      "    return {'rewards': [0] * 4, 'extra_logs': {'acc': [1, 2]}}\n",
                      r"returned 2 extra_logs\['acc'\] for 4 samples; an extra_logs value is one number"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_reward_function_errors_name_the_file_and_problem(tmp_path, case):
    body, pattern = BAD[case]
    src = PythonRewardFunction(write(tmp_path, body), retries=1)
    with pytest.raises(RewardError, match=pattern):
        src.score(["q"] * 4, ["p"] * 4, ["l"] * 4)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--reward.remote_url=.*missing\.py.*not found"):
        PythonRewardFunction(tmp_path / "missing.py")
    with pytest.raises(ValueError, match=r"must end in \.py"):
        PythonRewardFunction(tmp_path / "reward.txt")
    with pytest.raises(RewardError, match=r"defines no `reward_func` \(it defines: reward\)"):
        PythonRewardFunction(write(tmp_path, "def reward(q, p, l):\n    return q\n"))
    with pytest.raises(RewardError, match=r"importing .*bad_reward\.py raised ModuleNotFoundError: "
                                          r".*no_such_mod"):
        PythonRewardFunction(write(tmp_path, "import no_such_mod\n"))
    with pytest.raises(RewardError, match=r"cannot be called as reward_func\(queries, prompts, labels\)"):
        PythonRewardFunction(write(tmp_path, "def reward_func(queries):\n    return queries\n"))


def test_batch_arguments_are_checked(tmp_path):
    src = PythonRewardFunction(FUNCS / "plain_reward.py")
    with pytest.raises(ValueError, match="labels has 1 entries for 2 queries"):
        src.score(["a", "b"], ["", ""], ["x"])
    with pytest.raises(ValueError, match="on_error='ignore': valid values are"):
        PythonRewardFunction(FUNCS / "plain_reward.py", on_error="ignore")


def test_skip_marks_and_counts_samples(tmp_path):
    raising = PythonRewardFunction(write(tmp_path, BAD["raises"][0], "r1.py"), on_error="skip", retries=1)
    out = raising.score(["a", "b", "c"], ["", "", ""], None)
    assert out.skipped.tolist() == [True] * 3 and out.rewards.tolist() == [0.0] * 3
    assert "raised ZeroDivisionError" in out.skip_reasons[0] and raising.num_skipped == 3

    nan = PythonRewardFunction(write(tmp_path, BAD["nan"][0], "r2.py"), on_error="skip")
    out = nan.score(["q"] * 4, ["p"] * 4, None)
    assert out.skipped.tolist() == [False, False, True, True]
    assert out.rewards.tolist() == [0.0, 1.0, 0.0, 0.0] and out.num_skipped == 2
    assert len(out.skip_reasons) == 2 and nan.num_skipped == 2
    nan.score(["q"] * 4, ["p"] * 4, None)
    assert nan.num_skipped == 4 and nan.num_samples == 8

    short = PythonRewardFunction(write(tmp_path, BAD["wrong_length"][0], "r3.py"), on_error="skip")
    out = short.score(["q"] * 4, ["p"] * 4, None)
    assert out.num_skipped == 4 and "returned 3 rewards for 4 samples" in out.skip_reasons[0]


def test_parse_output_types():
    r = parse_output({"rewards": np.array([1, 2]), "scores": (0.5, True),
                      "extra_logs": {"a": np.float32(3), "b": torch.tensor([1, 0])}}, 2, "t")
    assert r.rewards.tolist() == [1.0, 2.0] and r.scores.tolist() == [0.5, 1.0]
    assert r.extra_logs["a"] == 3.0 and r.extra_logs["b"].tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"t: rewards has shape \(2, 1\); expected 1-D with 2 values"):
        parse_output(torch.zeros(2, 1), 2, "t")
    with pytest.raises(RewardError, match="t: returned str; expected a dict"):
        parse_output("1.0", 1, "t")
    with pytest.raises(RewardError, match="t: score 1 is -inf"):
        parse_output({"rewards": [0, 0], "scores": [0, -math.inf]}, 2, "t")
    js = RewardResult(torch.tensor([1.0, 2.0]), extra_logs={"m": 0.5}).to_json()
    assert js == {"rewards": [1.0, 2.0], "scores": [1.0, 2.0], "extra_logs": {"m": 0.5},
                  "skipped": [False, False], "skip_reasons": []}


# --- timeout and retries ---------------------------------------------------------------------------

def test_a_function_that_never_returns_times_out(tmp_path):
    path = write(tmp_path, """
        import time
        def reward_func(queries, prompts, labels):
            time.sleep(3600)
    """, "hangs.py")
    src = PythonRewardFunction(path, timeout=0.3, retries=2, backoff=0)
    with pytest.raises(RewardError) as err:
        src.score(["a"], [""], None)
    # it returned while the function still slept
    assert any(t.name == "reward_func hangs.py" for t in threading.enumerate())
    msg = str(err.value)
    assert msg.startswith(f"reward function {path}: reward_func did not return within 0.3s "
                          "(--reward.timeout) and is still running (blocked outside Python code, so not "
                          "retried);")
    assert f'File "{path}", line 4, in reward_func\n    time.sleep(3600)' in msg  # where it was stuck
    assert "python_func.py" not in msg and src.num_timeouts == 1 and src.stuck_calls == 1

    skip = PythonRewardFunction(path, on_error="skip", timeout=0.2, retries=1)
    out = skip.score(["a", "b"], ["", ""], None)
    assert out.skipped.tolist() == [True, True] and skip.num_skipped == 2
    assert "did not return within 0.2s (--reward.timeout)" in out.skip_reasons[0]
    assert "\n" not in out.skip_reasons[0]


def test_stuck_calls_are_bounded_then_refused_at_once(tmp_path):
    path = write(tmp_path, """
        import time
        def reward_func(queries, prompts, labels):
            if queries[0] == "quick":
                return [1.0]
            time.sleep(3600)
    """, "hangs.py")
    src = PythonRewardFunction(path, timeout=0.1, backoff=0, max_stuck=2)  # the default 3 attempts
    for stuck in (1, 2):  # a call stuck in C code fails its batch at once: one thread per hang
        with pytest.raises(RewardError, match="still running") as err:
            src.score(["a"], [""], None)
        assert not isinstance(err.value, RewardBusy) and src.stuck_calls == stuck == src.num_timeouts
    busy = (rf"{path}: 2 timed-out reward_func call\(s\) still running past the 0.1s --reward.timeout \(a "
            rf"thread")
    for query in ("a", "quick"):  # no thread is started any more, a quick call included
        with pytest.raises(RewardBusy, match=busy):
            src.score([query], [""], None)
    assert src.num_timeouts == 2 and src.stuck_calls == 2
    skip = PythonRewardFunction(path, on_error="skip", timeout=0.1, max_stuck=1)
    assert "did not return within 0.1s" in skip.score(["a"], [""], None).skip_reasons[0]
    with pytest.raises(RewardBusy, match="1 timed-out reward_func call"):  # not "skipped": nothing ran
        skip.score(["quick"], [""], None)
    assert skip.stuck_calls == 1 and skip.num_timeouts == 1 and skip.num_skipped == 1


def test_one_call_stuck_in_c_code_strands_one_thread_and_later_batches_still_score(tmp_path):
    """With the default 3 attempts and max_stuck 4, a batch that hangs in C code must not use up three of
    the four threads: after two hanging batches, a quick batch is still scored."""
    path = write(tmp_path, """
        import threading
        RELEASE = threading.Event()
        def reward_func(queries, prompts, labels):
            if queries[0] == "hang":
                RELEASE.wait()
            return [1.0] * len(queries)
    """, "hangs_on_a_lock.py")
    src = PythonRewardFunction(path, timeout=0.2, backoff=0)
    try:
        for _ in range(2):
            with pytest.raises(RewardError, match="did not return within 0.2s"):
                src.score(["hang"], [""], None)
        assert src.stuck_calls == 2
        assert src.score(["quick"], [""], None).rewards.tolist() == [1.0]
    finally:
        src.fn.__globals__["RELEASE"].set()


def test_a_function_that_hangs_once_in_python_code_is_stopped_and_retried(tmp_path):
    path = write(tmp_path, """
        CALLS = []
        def reward_func(queries, prompts, labels):
            CALLS.append(len(queries))
            while len(CALLS) == 1:
                pass
            return [float(len(CALLS))] * len(queries)
    """, "flaky.py")
    src = PythonRewardFunction(path, timeout=1, retries=2, backoff=0)  # 1 s: the retry's margin when busy
    out = src.score(["a", "b"], ["", ""], None)
    assert out.rewards.tolist() == [2.0, 2.0] and src.fn.__globals__["CALLS"] == [2, 2]
    assert src.num_timeouts == 1 and src.num_calls == 1


def test_an_abandoned_busy_call_is_stopped(tmp_path):
    path = write(tmp_path, """
        def reward_func(queries, prompts, labels):
            n = 0
            while True:
                n += 1
    """, "busy.py")
    src = PythonRewardFunction(path, timeout=0.2, retries=1)
    with pytest.raises(RewardError, match=r"busy\.py: reward_func did not return within 0.2s"):
        src.score(["a"], [""], None)
    deadline = time.monotonic() + 60  # a generous cap: the loop ends as soon as the thread has stopped
    while any(t.name == "reward_func busy.py" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "reward_func busy.py" for t in threading.enumerate())  # not burning CPU any more


def test_a_raising_function_is_retried_like_http(tmp_path):
    path = write(tmp_path, """
        CALLS = []
        def reward_func(queries, prompts, labels):
            CALLS.append(1)
            if len(CALLS) < 3:
                raise ConnectionError("judge API unreachable")
            return [1.0] * len(queries)
    """, "transient.py")
    src = PythonRewardFunction(path, retries=3, backoff=0)
    assert src.score(["a"], [""], None).rewards.tolist() == [1.0]
    failing = PythonRewardFunction(path, retries=2, backoff=0)
    with pytest.raises(RewardError, match=r"raised ConnectionError: judge API unreachable "
                                          r"\(at .*transient\.py:6\) \(2 attempts, --reward.retries\)"):
        failing.score(["a"], [""], None)


def test_timeout_and_retries_are_wired_through_make_reward_source(tmp_path):
    path = write(tmp_path, "def reward_func(queries, prompts, labels):\n    return [0.0] * len(queries)\n")
    src = make_reward_source(path, timeout=1.5, retries=5)
    assert (src.timeout, src.retries) == (1.5, 5)
    assert make_reward_source(path).timeout == 300.0  # default for a Python grader on a whole batch
    assert make_reward_source("http://127.0.0.1:9/get_reward").timeout == 30.0
    with pytest.raises(ValueError, match=r"--reward.timeout=0: must be > 0"):
        PythonRewardFunction(path, timeout=0)
    with pytest.raises(ValueError, match=r"--reward.retries=0: must be >= 1"):
        PythonRewardFunction(path, retries=0)
    untimed = PythonRewardFunction(path, timeout=None)  # runs in the caller's thread
    assert untimed.score(["a"], [""], None).rewards.tolist() == [0.0]


# --- errors in user code: one message with the user's traceback lines ------------------------------

def test_syntax_error_shows_file_line_and_code(tmp_path):
    path = write(tmp_path, """
        import torch

        def reward_func(queries, prompts, labels):
            return [1.0 for q in queries
    """, "syntax.py")
    with pytest.raises(RewardError) as err:
        PythonRewardFunction(path)
    msg = str(err.value)
    assert msg.startswith(f"reward function file {path} has a syntax error: ")
    assert f"(at {path}:5)" in msg and "    return [1.0 for q in queries" in msg
    assert "<frozen" not in msg and "python_func.py" not in msg


def test_import_error_shows_the_user_frames_only(tmp_path):
    (tmp_path / "helpers.py").write_text("def load_table():\n    raise KeyError('table.csv')\n")
    path = write(tmp_path, """
        from helpers import load_table

        TABLE = load_table()
    """, "imports.py")
    with pytest.raises(RewardError) as err:
        PythonRewardFunction(path)
    msg = str(err.value)
    assert msg.startswith(f"importing reward function file {path} raised KeyError: 'table.csv' "
                          f"(at {tmp_path / 'helpers.py'}:2)\nTraceback (user code, most recent call last):")
    assert f'File "{path}", line 4, in <module>\n    TABLE = load_table()' in msg
    helpers = tmp_path / "helpers.py"
    assert f'File "{helpers}", line 2, in load_table\n    raise KeyError(\'table.csv\')' in msg
    assert "<frozen" not in msg and "posttrain" not in msg.replace(str(tmp_path), "")


def test_raising_reward_func_shows_the_user_frames_only(tmp_path):
    path = write(tmp_path, """
        def parse(label):
            return int(label)

        def reward_func(queries, prompts, labels):
            return [parse(x) for x in labels]
    """, "raising.py")
    with pytest.raises(RewardError) as err:
        PythonRewardFunction(path, retries=1).score(["a"], [""], ["seven"])
    msg = str(err.value)
    assert msg.startswith(f"reward function {path} raised ValueError: invalid literal for int() with "
                          f"base 10: 'seven' (at {path}:3)\nTraceback (user code, most recent call last):\n")
    assert f'File "{path}", line 6, in reward_func\n    return [parse(x) for x in labels]' in msg
    assert f'File "{path}", line 3, in parse\n    return int(label)' in msg
    assert "python_func.py" not in msg and "threading.py" not in msg


@pytest.mark.parametrize("case", ["nan", "wrong_length"])
def test_bad_return_values_point_at_reward_func(tmp_path, case):
    path = write(tmp_path, BAD[case][0])
    with pytest.raises(RewardError, match=BAD[case][1]) as err:
        PythonRewardFunction(path).score(["q"] * 4, ["p"] * 4, ["l"] * 4)
    line = 2 if case == "wrong_length" else 1
    assert str(err.value).endswith(f"\nreward_func is defined at {path}:{line}")


def test_library_and_neighbour_errors_point_at_the_users_code(tmp_path):
    (tmp_path / "broken_helper.py").write_text("def f(:\n    pass\n")
    with pytest.raises(RewardError, match=r"importing reward function file .*uses_helper\.py: "
                                          r".*broken_helper\.py has a syntax error: "
                                          r".*\(at .*broken_helper\.py:1\)") as err:
        PythonRewardFunction(write(tmp_path, "import broken_helper\n", "uses_helper.py"))
    assert "import broken_helper" in str(err.value) and "def f(:" in str(err.value)

    path = write(tmp_path, """
        import json

        def reward_func(queries, prompts, labels):
            return json.loads(labels[0])
    """, "lib.py")
    with pytest.raises(RewardError, match=rf"raised JSONDecodeError: .* \(at {path}:5\)"):
        PythonRewardFunction(path, retries=1).score(["a"], [""], ["{bad"])


def test_deep_tracebacks_are_shortened(tmp_path):
    path = write(tmp_path, """
        def down(n):
            if n == 0:
                raise RecursionError("too deep for this grader")
            return down(n - 1)

        def reward_func(queries, prompts, labels):
            return down(30)
    """, "deep.py")
    with pytest.raises(RewardError) as err:
        PythonRewardFunction(path, retries=1).score(["a"], [""], None)
    msg = str(err.value)
    assert "  ... 22 frames left out ...\n" in msg and msg.count(f'File "{path}"') < 10
    assert msg.index('line 8, in reward_func\n    return down(30)') < msg.index("frames left out")
    assert msg.endswith('line 4, in down\n    raise RecursionError("too deep for this grader")')


def test_sys_exit_while_importing_or_calling_is_an_error_of_the_file(tmp_path):
    with pytest.raises(RewardError, match=r"importing reward function file .*exits_on_import.py raised "
                                          r"UserFileExit: it called sys.exit\(3\) at .*exits_on_import.py:2"):
        PythonRewardFunction(write(tmp_path, "import sys\nsys.exit(3)\n", name="exits_on_import.py"))
    body = "import sys\n\ndef reward_func(queries, prompts, labels):\n    sys.exit(0)\n"
    for timeout in (None, 5.0):
        src = PythonRewardFunction(write(tmp_path, body, name="exits.py"), timeout=timeout, retries=3,
                                   backoff=0)
        with pytest.raises(RewardError, match=r"exits.py raised UserFileExit: it called sys.exit\(0\) at "
                                              r".*exits.py:4") as err:
            src.score(["a"], ["p"])
        assert "attempts" not in str(err.value)  # not retried



@pytest.mark.e2e
def test_a_fork_child_started_while_a_reward_file_loads_exits_normally(tmp_path):
    """The `os._exit` guard of a loading file applies to the loading thread only: multiprocessing's fork
    child ends with `os._exit(0)` and must not run posttrain's error path (and its clean-ups) instead."""
    import subprocess
    import sys

    path = write(tmp_path, """\
        import multiprocessing as mp
        import os

        def child():
            print("child ran", flush=True)

        proc = mp.get_context("fork").Process(target=child)
        proc.start()
        proc.join()
        CHILD_EXIT = proc.exitcode

        def reward_func(queries, prompts, labels):
            return [float(CHILD_EXIT)] * len(queries)
        """, name="forks_on_import.py")
    script = ("import os, sys\nfrom posttrain.rewards import PythonRewardFunction\n"
              "try:\n    src = PythonRewardFunction(sys.argv[1])\n"
              "except BaseException as err:\n    print('pid', os.getpid(), 'failed:', err, flush=True)\n    "
              "raise\nprint('pid', os.getpid(), 'scores', src.score(['a'], ['p']).rewards.tolist(), "
              "flush=True)\n")
    out = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=120,
                         check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "child ran" and len(lines) == 2 and lines[1].endswith("scores [0.0]"), out.stdout
    assert "UserFileExit" not in out.stderr
