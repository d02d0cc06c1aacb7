"""Agent file (`--train.agent_func_path`): the calculator task with the tool (see calculator.py)."""
from posttrain.agents.agent_api import MultiTurnAgentExecutor
from posttrain.agents.examples.calculator import CalculatorInstance


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(CalculatorInstance)
