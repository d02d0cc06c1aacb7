"""The shipped multi-turn task (agents/examples/calculator.py): tool calls, rewards, the single-turn
control, and SFT transcripts that render exactly as RL episodes are fed."""
import asyncio

import pytest

from posttrain.agents.agent_file import load_agent_executor
from posttrain.agents.examples import CALCULATOR_AGENT, CALCULATOR_NO_TOOL
from posttrain.agents.examples.calculator import (
    END,
    CalculatorInstance,
    NoToolInstance,
    feedback,
    make_calculator_rows,
)

OBS = "<|im_start|>user\nWhat is 23 * 7?<|im_end|>\n<|im_start|>assistant\n"


def step(env, action, label="161"):
    return asyncio.run(env.step({"observation_text": OBS, "action_text": action + END, "label": label}))


def test_tool_calls_answer_and_the_final_number_is_graded():
    env = CalculatorInstance()
    r = step(env, "calc")
    assert (r["environment_feedback"], r["rewards"], r["done"]) == (feedback("= 161"), 0.0, False)
    assert step(env, "calc 12 + 30")["environment_feedback"] == feedback("= 42")
    assert step(env, "calc")["done"] is True  # a third call: over the limit, episode ends unrewarded
    assert step(CalculatorInstance(), "161") == {"rewards": 1.0, "scores": 1.0, "environment_feedback": "",
                                                  "done": True, "extra_logs": {"tool_calls": 0.0}}
    assert step(CalculatorInstance(), "160")["rewards"] == 0.0
    assert step(CalculatorInstance(), "it is 161")["rewards"] == 0.0  # the answer is the number alone
    no_tool = step(NoToolInstance(), "calc")
    assert no_tool["done"] is True and no_tool["rewards"] == 0.0


def test_agent_files_load():
    assert load_agent_executor(CALCULATOR_AGENT).agent_instance_cls is CalculatorInstance
    assert load_agent_executor(CALCULATOR_NO_TOOL).agent_instance_cls is NoToolInstance


def test_transcripts_render_as_episodes_are_fed(tiny_model_dir):
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    rows = make_calculator_rows(200, seed=3, tool_use=0.5)
    tools = [r for r in rows if len(r["messages"]) == 4]
    assert 60 < len(tools) < 140 and all(int(r["answer"]) == eval(r["prompt"][8:-1]) for r in rows)
    direct = [r for r in rows if len(r["messages"]) == 2]
    # guesses, rarely right
    assert sum(r["messages"][1]["content"] == r["answer"] for r in direct) <= 0.2 * len(direct)
    r = tools[0]
    obs = tok.apply_chat_template(r["messages"][:1], tokenize=False, add_generation_prompt=True)
    episode = obs + "calc" + END + feedback(f"= {r['answer']}") + r["answer"] + END
    assert tok.apply_chat_template(r["messages"], tokenize=False).startswith(episode)


@pytest.mark.parametrize("action", ["calc 1 * ", "calcx", "1,081"])
def test_anything_else_is_a_wrong_final_answer(action):
    assert step(CalculatorInstance(), action)["rewards"] == 0.0
