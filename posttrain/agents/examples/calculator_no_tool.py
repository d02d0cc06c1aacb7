"""Agent file (`--train.agent_func_path`): the calculator task without the tool, a single-turn control
(a tool call ends the episode with reward 0; see calculator.py)."""
from posttrain.agents.agent_api import MultiTurnAgentExecutor
from posttrain.agents.examples.calculator import NoToolInstance


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(NoToolInstance)
