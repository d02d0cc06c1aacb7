"""Reward and agent files written for OpenRLHF load unchanged: without OpenRLHF installed, `openrlhf`,
`openrlhf.utils` and `openrlhf.utils.agent` resolve to posttrain's stand-ins (announced once); a real
openrlhf always wins."""
import importlib.util
import sys
import textwrap

import pytest
import torch

from posttrain.compat import openrlhf_modules
from posttrain.rewards import PythonRewardFunction, RewardError
from posttrain.rewards.math_grading import extract_boxed_answer, grade_answer

REAL_OPENRLHF = importlib.util.find_spec("openrlhf") is not None
needs_no_openrlhf = pytest.mark.skipif(REAL_OPENRLHF, reason="a real openrlhf is installed")


def _drop_openrlhf_modules():
    for name in [n for n in sys.modules if n == "openrlhf" or n.startswith("openrlhf.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def clean_openrlhf():
    openrlhf_modules.uninstall()
    _drop_openrlhf_modules()
    yield
    openrlhf_modules.uninstall()
    _drop_openrlhf_modules()


def write(folder, name, body):
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# Same imports and call pattern as OpenRLHF's examples/python/math_reward_func.py.
MATH_REWARD = """
    import torch

    from openrlhf.utils import extract_boxed_answer, grade_answer


    def reward_func(queries, prompts, labels, **kwargs):
        scores = []
        for text, prompt, gold in zip(queries, prompts, labels):
            answer_part = text[len(prompt):] if isinstance(prompt, str) and prompt in text else text
            predicted = extract_boxed_answer(answer_part)
            scores.append(1.0 if grade_answer(predicted, gold) else 0.0)
        scores = torch.tensor(scores, dtype=torch.float)
        return {"rewards": scores, "scores": scores, "extra_logs": {"math_accuracy": scores.mean()}}
"""

# Same shape as OpenRLHF's examples/python/reward_func.py (random 0/1 rewards, per-sample extra log).
RANDOM_REWARD = """
    import torch


    def reward_func(queries, prompts, labels, **kwargs):
        coin = torch.randint(0, 2, (len(queries),)).float()
        return {"rewards": coin, "scores": coin, "extra_logs": {"dummy_scores": coin}}
"""

AGENT_FILE = """
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            self.turn = 0

        async def step(self, states, **kwargs):
            return {"rewards": 0.0, "scores": 0.0, "environment_feedback": "", "done": True}


    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)


    def reward_func(queries, prompts, labels):
        return [0.0] * len(queries)
"""


@needs_no_openrlhf
def test_openrlhf_math_reward_file_loads_and_scores(tmp_path, capsys):
    path = write(tmp_path, "math_reward_func.py", MATH_REWARD)
    src = PythonRewardFunction(path)
    announced = capsys.readouterr().err
    assert (f"openrlhf is not installed: `openrlhf.utils` in {path} resolves to posttrain's "
            "posttrain.rewards.math_grading (extract_boxed_answer, grade_answer)") in announced
    assert src.fn.__globals__["grade_answer"] is grade_answer
    assert src.fn.__globals__["extract_boxed_answer"] is extract_boxed_answer
    prompts = ["What is 1/2?", "Simplify sqrt(x^2) for x>0.", "What is 2+2?", "What is 3*3?", "Solve."]
    responses = [" \\boxed{0.5}", " it is \\boxed{\\sqrt{x^{2}}} hmm, no: \\boxed{x}", " \\boxed{5}",
                 " nine", " \\boxed{1+x}"]
    labels = ["\\frac{1}{2}", "x", "4", "9", "x+1"]
    out = src.score([p + r for p, r in zip(prompts, responses)], prompts, labels)
    assert out.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert out.extra_logs["math_accuracy"] == pytest.approx(0.6)

    PythonRewardFunction(write(tmp_path, "again.py", MATH_REWARD))  # announced once per process
    assert "openrlhf is not installed" not in capsys.readouterr().err


def test_openrlhf_random_reward_file_scores(tmp_path):
    src = PythonRewardFunction(write(tmp_path, "reward_func.py", RANDOM_REWARD))
    out = src.score(["a", "b", "c"], [""] * 3, None)
    assert set(out.rewards.tolist()) <= {0.0, 1.0}
    assert torch.equal(out.extra_logs["dummy_scores"], out.rewards)


@needs_no_openrlhf
def test_agent_file_imports_and_its_executor_is_posttrains(tmp_path, capsys):
    from posttrain.agents.agent_api import MultiTurnAgentExecutor
    from posttrain.agents.agent_file import load_agent_executor

    path = write(tmp_path, "agent_func.py", AGENT_FILE)
    executor = load_agent_executor(path)
    assert "`openrlhf.utils.agent` in" in capsys.readouterr().err
    assert isinstance(executor, MultiTurnAgentExecutor)
    assert executor.agent_instance_cls.__name__ == "AgentInstance" and executor.agent_instance_cls().turn == 0


@needs_no_openrlhf
def test_names_and_modules_the_stand_in_lacks_are_named(tmp_path):
    with pytest.raises(RewardError, match=r"OpenRLHFNameUnavailable: `from openrlhf.utils import "
                                          r"get_tokenizer`: openrlhf is not installed .* "
                                          r"pip install openrlhf"):
        PythonRewardFunction(write(tmp_path, "r1.py", "from openrlhf.utils import get_tokenizer\n"))
    with pytest.raises(RewardError, match=r"No module named 'openrlhf.models': openrlhf is not installed and "
                                          r"posttrain's stand-in covers only openrlhf.utils"):
        PythonRewardFunction(write(tmp_path, "r2.py", "from openrlhf.models import Actor\n"))


def test_a_real_openrlhf_is_never_shadowed(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "site" / "openrlhf"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "utils" / "__init__.py").write_text(
        "REAL = True\n"
        "def extract_boxed_answer(text):\n    return 'from-real'\n"
        "def grade_answer(given, truth):\n    return given == 'from-real'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    openrlhf_modules.install()
    path = write(tmp_path, "math_reward_func.py", MATH_REWARD)
    out = PythonRewardFunction(path).score(["q \\boxed{1}"], ["q"], ["2"])
    assert out.rewards.tolist() == [1.0]  # the fake grader said yes to its own marker
    assert sys.modules["openrlhf.utils"].REAL and not openrlhf_modules.is_stand_in(sys.modules["openrlhf"])
    assert "openrlhf is not installed" not in capsys.readouterr().err


def test_a_real_openrlhf_beside_the_reward_file_wins(tmp_path, capsys):
    (tmp_path / "openrlhf" / "utils").mkdir(parents=True)
    (tmp_path / "openrlhf" / "__init__.py").write_text("")
    (tmp_path / "openrlhf" / "utils" / "__init__.py").write_text(
        "def extract_boxed_answer(text):\n    return None\n"
        "def grade_answer(given, truth):\n    return True\n")
    out = PythonRewardFunction(write(tmp_path, "math_reward_func.py", MATH_REWARD)).score(["x"], [""], ["y"])
    assert out.rewards.tolist() == [1.0]
    assert "openrlhf is not installed" not in capsys.readouterr().err
