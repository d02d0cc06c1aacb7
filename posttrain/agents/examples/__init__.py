"""Agent files shipped with posttrain, in OpenRLHF's `--train.agent_func_path` format: a calculator
tool task where the environment's feedback is needed to succeed (`calculator.py`), as the agent file
with the tool (`calculator_agent.py`) and without it (`calculator_no_tool.py`, the single-turn control).
Tool files (`--train.tool_path`): the same calculator as a function (`calculator_tools.py`, which takes the
operands) and as an environment class that knows the episode's question (`calculator_env.py`), and a
key-value search over shipped facts (`kv_search_tools.py`, `kv_facts.jsonl`, `kv_search_prompts.jsonl`),
both scored by `final_answer_reward.py`."""
from pathlib import Path

CALCULATOR_AGENT = str(Path(__file__).with_name("calculator_agent.py"))
CALCULATOR_NO_TOOL = str(Path(__file__).with_name("calculator_no_tool.py"))
CALCULATOR_TOOLS = str(Path(__file__).with_name("calculator_tools.py"))
CALCULATOR_ENV = str(Path(__file__).with_name("calculator_env.py"))
KV_SEARCH_TOOLS = str(Path(__file__).with_name("kv_search_tools.py"))
KV_SEARCH_PROMPTS = str(Path(__file__).with_name("kv_search_prompts.jsonl"))
FINAL_ANSWER_REWARD = str(Path(__file__).with_name("final_answer_reward.py"))
