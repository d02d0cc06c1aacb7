"""An agent environment for the concurrency tests: every episode lasts three turns, its reward is
`reward(action_text)`, and each step sleeps a few milliseconds chosen by the action, so that concurrent
episodes interleave differently from one another."""
import asyncio

from posttrain.agents.agent_api import AgentInstanceBase


class ThreeTurns(AgentInstanceBase):
    reward = staticmethod(lambda action_text: 1.0)

    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        await asyncio.sleep(0.001 * (hash(states["action_text"]) % 5))  # episodes interleave differently
        return {"rewards": self.reward(states["action_text"]), "environment_feedback": " again:",
                "done": self.turn == 3}
