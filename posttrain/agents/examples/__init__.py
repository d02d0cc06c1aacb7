"""Agent files shipped with posttrain, in OpenRLHF's `--train.agent_func_path` format: a calculator
tool task where the environment's feedback is needed to succeed (`calculator.py`), as the agent file
with the tool (`calculator_agent.py`) and without it (`calculator_no_tool.py`, the single-turn control)."""
from pathlib import Path

CALCULATOR_AGENT = str(Path(__file__).with_name("calculator_agent.py"))
CALCULATOR_NO_TOOL = str(Path(__file__).with_name("calculator_no_tool.py"))
