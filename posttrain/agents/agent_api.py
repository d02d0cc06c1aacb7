"""OpenRLHF's agent API names (`openrlhf.utils.agent`), as placeholders: multi-turn agents are not
available in this version of posttrain.

An OpenRLHF agent file defines `class AgentInstance(AgentInstanceBase)` (async `reset(states)` /
`step(states)`) and `class AgentExecutor(MultiTurnAgentExecutor)` at module level, so these classes
exist and can be subclassed: such a file imports cleanly. Creating any executor (an instance of
`AgentExecutorBase` or a subclass, e.g. `AgentExecutor()`) raises `AgentsUnavailableError`, a
UserError, instead of running an agent loop that does not exist.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from posttrain.utils.errors import UserError

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "AgentsUnavailableError", "MultiTurnAgentExecutor",
           "SingleTurnAgentExecutor"]


class AgentsUnavailableError(UserError, NotImplementedError):
    """An agent executor was created: multi-turn agents are not available in this posttrain version."""


class AgentInstanceBase(ABC):
    """One environment per prompt: `await reset(states)` returns `{"observation": text}`, `await
    step(states)` returns `{"rewards", "scores", "environment_feedback", "done", ...}` (OpenRLHF's
    contract). Only the interface exists here; nothing in posttrain drives it yet."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        raise NotImplementedError


class AgentExecutorBase(ABC):
    """Base of the executors; creating one raises AgentsUnavailableError (module doc)."""

    def __new__(cls, *args, **kwargs):
        raise AgentsUnavailableError(
            f"{cls.__name__}: multi-turn agents (OpenRLHF's `openrlhf.utils.agent` executors, "
            "--train.agent_func_path) are not available in this version of posttrain; score single "
            "responses with a reward_func file (--reward.remote_url reward.py) instead")

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        raise NotImplementedError


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's `MultiTurnAgentExecutor(agent_instance_cls)`; placeholder (module doc)."""

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        raise NotImplementedError


class SingleTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's `SingleTurnAgentExecutor(remote_rm_url)`; placeholder (module doc). posttrain's own
    single-turn rollout is `posttrain.agents.single_turn`."""

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        raise NotImplementedError
