"""Agent file (`--train.agent_func_path`): an agent that drives the policy through the official `openai`
client with OpenAI tool calling (docs/agents.md, "Tool calling"). The policy may call `add(a, b)`; each
call's result goes back as a `tool` message, and its first reply without a tool call is its answer:
reward 1 when a number in it equals the label (the shipped prompts: "What is 85 + 3?", label "88"). At
most `max_tool_calls` calls per episode; `extra_logs` reports how many it made (`reward/tool_calls`)."""
from __future__ import annotations

import json
import re

from posttrain.agents.openai_server import OpenAIServerAgentExecutor

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def run_tool(function) -> str:
    """The result of one call, or an error the model reads when the call does not fit the tool."""
    if function.name != "add":
        return f"error: unknown function {function.name!r}; the only tool is add(a, b)"
    try:
        args = json.loads(function.arguments)
        return str(int(args["a"]) + int(args["b"]))
    except (ValueError, KeyError, TypeError) as e:
        return f"error: {type(e).__name__}: {e}"


class AgentExecutor(OpenAIServerAgentExecutor):
    max_tool_calls = 3

    async def run_agent(self, prompt, label, session):
        client = session.openai_client()
        messages, calls = [{"role": "user", "content": prompt}], 0
        try:
            while True:
                reply = await client.chat.completions.create(model=session.model, messages=messages,
                                                             tools=TOOLS)
                message = reply.choices[0].message
                if not message.tool_calls or calls >= self.max_tool_calls:
                    numbers = re.findall(r"-?\d+", message.content or "")
                    return {"reward": float(str(label) in numbers), "extra_logs": {"tool_calls": calls}}
                messages.append(message)  # the call as served: the session keeps its sampled tokens
                for call in message.tool_calls:
                    calls += 1
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": run_tool(call.function)})
        finally:
            await client.close()
