"""Tool file (`--train.tool_path`): a key-value "search" tool over the facts shipped beside it
(`kv_facts.jsonl`, one `{"key", "value"}` per line). The prompts (`kv_search_prompts.jsonl`) ask for a
fact's value; `final_answer_reward.py` pays 1 when the model's final answer is it. See docs/agents.md,
Tool environments, for a command that runs it."""
import json
from pathlib import Path

SYSTEM_PROMPT = "Look facts up with the search tool, then answer with the value alone."
MAX_TOOL_CALLS = 3
TOOL_TIMEOUT = 5
MAX_TOOL_OUTPUT = 200

_FACTS = {row["key"].lower(): row["value"]
          for row in map(json.loads, Path(__file__).with_name("kv_facts.jsonl").read_text().splitlines())}


def search(key: str) -> str:
    """Look a fact up by its key.

    Args:
        key: the fact's key, e.g. "capital of Varnia"
    """
    value = _FACTS.get(key.strip().lower())
    return value if value is not None else f"no fact for {key!r}"
