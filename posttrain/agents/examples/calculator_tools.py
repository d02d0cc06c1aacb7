"""Tool file (`--train.tool_path`): the calculator task of `calculator.py` as plain functions. The model
calls `multiply` with the question's numbers in its chat template's tool-call format and answers with the
number; `final_answer_reward.py` (`--reward.remote_url`) pays 1 when that answer is the label."""

MAX_TOOL_CALLS = 2  # as the agent file's CalculatorInstance.max_tool_calls


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b
