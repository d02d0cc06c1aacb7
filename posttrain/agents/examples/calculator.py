"""A task where turns matter: multiplication ("What is 23 * 7?"), which a tiny model cannot compute in
one step, with a calculator tool it can call.

Protocol (ChatML, the chat template of `posttrain init-tiny` models): the policy answers either with a
number (its final answer: reward 1 when it equals the label, episode over) or with a tool call:
`calc` (the question's product) or `calc A * B` (any product, sum or difference); the environment
replies as the user with `= <value>` and the policy continues. A transcript therefore renders exactly
as the chat template renders the conversation [user question, assistant "calc", user "= 1081",
assistant "1081"], so multi-turn SFT data and RL episodes have the same tokens. At most `max_tool_calls` calls
per episode; with 0 (the single-turn control) a tool call ends the episode with reward 0.
"""
from __future__ import annotations

import re

from posttrain.agents.agent_api import AgentInstanceBase

CALL = re.compile(r"^\s*calc(?:\s+(-?\d+)\s*([*+-])\s*(-?\d+))?\s*$")
QUESTION = re.compile(r"What is (-?\d+) \* (-?\d+)\?")
END = "<|im_end|>"


def feedback(text: str) -> str:
    """A user turn after an assistant turn that ended with `<|im_end|>`, then the assistant header."""
    return f"\n<|im_start|>user\n{text}{END}\n<|im_start|>assistant\n"


def evaluate_call(action: str, observation: str) -> int | None:
    """The tool's answer to `action`, or None when it is not a tool call."""
    m = CALL.match(action)
    if m is None:
        return None
    if m.group(1) is None:  # bare `calc`: the question's product
        q = QUESTION.search(observation)
        return int(q.group(1)) * int(q.group(2)) if q else 0
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a * b if op == "*" else a + b if op == "+" else a - b


def final_answer(action: str) -> str | None:
    m = re.fullmatch(r"\s*(-?\d+)\s*", action)
    return m.group(1) if m else None


class CalculatorInstance(AgentInstanceBase):
    max_tool_calls = 2

    def __init__(self, *args, **kwargs):
        self.calls = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        action = states["action_text"].replace(END, "").replace("<|endoftext|>", "")
        value = evaluate_call(action, states["observation_text"])
        if value is not None:
            self.calls += 1
            if self.calls <= self.max_tool_calls:
                return {"rewards": 0.0, "scores": 0.0, "environment_feedback": feedback(f"= {value}"),
                        "done": False, "extra_logs": {"tool_calls": float(self.calls)}}
            return {"rewards": 0.0, "scores": 0.0, "environment_feedback": "", "done": True,
                    "extra_logs": {"tool_calls": float(self.calls)}}
        correct = float(final_answer(action) == str(states["label"]))
        return {"rewards": correct, "scores": correct, "environment_feedback": "", "done": True,
                "extra_logs": {"tool_calls": float(self.calls)}}


class NoToolInstance(CalculatorInstance):
    max_tool_calls = 0


def _problems(n: int, seed: int, tool_use: float):
    """(a, b, whether the demonstrator calls the tool, its guess otherwise) of `n` problems, in order."""
    import random

    rng = random.Random(f"calc-{seed}")
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        if rng.random() < tool_use:
            yield a, b, True, None
        else:
            yield a, b, False, a * b // 10 * 10 + rng.randint(0, 9)


def make_calculator_rows(n: int, seed: int = 0, tool_use: float = 0.4) -> list[dict]:
    """`n` problems `What is A * B?` (A in [10, 99], B in [2, 9]) with `answer` and a demonstration in
    `messages`: with probability `tool_use` the calculator transcript, otherwise a direct answer that is a
    guess (the true product with its last digit redrawn, as a model that cannot multiply would answer)."""
    rows = []
    for a, b, tool, guess in _problems(n, seed, tool_use):
        question, value = f"What is {a} * {b}?", a * b
        if tool:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "calc"},
                        {"role": "user", "content": f"= {value}"},
                        {"role": "assistant", "content": str(value)}]
        else:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": str(guess)}]
        rows.append({"prompt": question, "answer": str(value), "messages": messages})
    return rows


def make_calculator_tool_rows(n: int, seed: int = 0, tool_use: float = 0.4,
                              environment: bool = False) -> list[dict]:
    """The problems and demonstrations of `make_calculator_rows` (same seed: same problems, same choices)
    for the tool file `calculator_tools.py` (or, with `environment`, `calculator_env.py`): the tool
    transcript is a `multiply` call with the question's numbers (a `calc` call with no arguments), its tool
    message and the answer, and each row carries the file's `tools`, so SFT renders it exactly as a tool
    episode is rendered (the same chat template, tools, tool call and tool message)."""
    from posttrain.agents.examples import CALCULATOR_ENV, CALCULATOR_TOOLS
    from posttrain.agents.tool_env import load_tool_file

    tools = load_tool_file(CALCULATOR_ENV if environment else CALCULATOR_TOOLS).schemas
    rows = []
    for a, b, tool, guess in _problems(n, seed, tool_use):
        question, value = f"What is {a} * {b}?", a * b
        if tool:
            name, arguments = ("calc", {}) if environment else ("multiply", {"a": a, "b": b})
            call = {"type": "function", "function": {"name": name, "arguments": arguments}}
            messages = [{"role": "user", "content": question},
                        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", **call}]},
                        {"role": "tool", "tool_call_id": "call_0", "name": name, "content": str(value)},
                        {"role": "assistant", "content": str(value)}]
        else:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": str(guess)}]
        rows.append({"prompt": question, "answer": str(value), "messages": messages, "tools": tools})
    return rows
