"""PythonRewardFunction: OpenRLHF-style reward_func files load and score a whole batch in one call;
every bad file / bad return value gives an error naming the file and the problem; on_error="skip"
marks and counts the affected samples."""
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.agents.rewards import (
    PythonRewardFunction,
    RewardError,
    RewardResult,
    RewardSource,
    parse_output,
)

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
    "not_numbers": ("def reward_func(queries, prompts, labels, **kw):\n    return {'rewards': [0, 1, 'x', 2]}\n",
                    r"bad_reward\.py: reward 2 is 'x' \(str\), not a number"),
    "bad_extra_log": ("def reward_func(queries, prompts, labels, **kw):\n"
                      "    return {'rewards': [0] * 4, 'extra_logs': {'acc': [1, 2]}}\n",
                      r"returned 2 extra_logs\['acc'\] for 4 samples; an extra_logs value is one number"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_reward_function_errors_name_the_file_and_problem(tmp_path, case):
    body, pattern = BAD[case]
    src = PythonRewardFunction(write(tmp_path, body))
    with pytest.raises(RewardError, match=pattern):
        src.score(["q"] * 4, ["p"] * 4, ["l"] * 4)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--reward.remote_url=.*missing\.py.*not found"):
        PythonRewardFunction(tmp_path / "missing.py")
    with pytest.raises(ValueError, match=r"must end in \.py"):
        PythonRewardFunction(tmp_path / "reward.txt")
    with pytest.raises(RewardError, match=r"defines no `reward_func` \(it defines: reward\)"):
        PythonRewardFunction(write(tmp_path, "def reward(q, p, l):\n    return q\n"))
    with pytest.raises(RewardError, match=r"importing .*bad_reward\.py raised ModuleNotFoundError: .*no_such_mod"):
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
    raising = PythonRewardFunction(write(tmp_path, BAD["raises"][0], "r1.py"), on_error="skip")
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
