"""Tool file with an environment (`--train.tool_path`, `ENVIRONMENT`): the calculator task of `calculator.py`
as its agent file plays it. One `Calculator` per episode; `reset` keeps the episode's prompt, so `calc()`
with no expression answers the question's product, as the agent file's bare `calc` does, and
`calc(expression="A * B")` any product, sum or difference. The model answers with the number;
`final_answer_reward.py` (`--reward.remote_url`) pays 1 when that answer is the label."""
from posttrain.agents.examples.calculator import evaluate_call

MAX_TOOL_CALLS = 2  # as the agent file's CalculatorInstance.max_tool_calls


class Calculator:
    def __init__(self):
        self.prompt = ""

    def reset(self, prompt: str, label=None, **kwargs) -> None:
        self.prompt = prompt

    def calc(self, expression: str = "") -> int:
        """Evaluate an arithmetic expression; with none, the question's product.

        Args:
            expression: `A * B`, `A + B` or `A - B` of two integers (empty: the question's two numbers)
        """
        value = evaluate_call(f"calc {expression}", self.prompt)
        if value is None:
            raise ValueError(f"expression {expression!r}: use A * B, A + B or A - B of two integers")
        return value


ENVIRONMENT = Calculator
