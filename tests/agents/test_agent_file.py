"""Loading an agent file (agents/agent_file.py): what cannot work is refused at start-up, naming the file."""
from __future__ import annotations

import sys
import textwrap

import pytest

from posttrain.agents.agent_file import AgentFileError, load_agent_executor

HEADER = """
    import sys
    from posttrain.agents.agent_api import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor
"""


def write(tmp_path, body, name="agent.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(HEADER) + textwrap.dedent(body))
    return str(path)


def test_sys_exit_in_an_agent_file_or_its_executor_is_an_error_of_the_file(tmp_path):
    with pytest.raises(AgentFileError, match=r"agent.py: importing it raised UserFileExit: it called "
                                             r"sys.exit\(0\)"):
        load_agent_executor(write(tmp_path, "sys.exit(0)\n"))
    body = """
        class AgentExecutor(AgentExecutorBase):
            def __init__(self):
                sys.exit(1)

            async def execute(self, *args, **kwargs):
                pass
        """
    with pytest.raises(AgentFileError, match=r"AgentExecutor\(\) raised UserFileExit: it called "
                                             r"sys.exit\(1\) at .*agent2.py:\d+"):
        load_agent_executor(write(tmp_path, body, name="agent2.py"))


@pytest.mark.parametrize("instance, needle", [
    ("class Env(AgentInstanceBase):\n    def __init__(self, *a, **k):\n        pass\n",
     r"Env\(\) with no arguments, which cannot work: it does not implement step \(abstract in "
     r"AgentInstanceBase\)"),
    ("class Env(AgentInstanceBase):\n    async def step(self, states, **k):\n        return {}\n",
     r"Env\(\) with no arguments, which cannot work: it does not implement __init__"),
    ("class Env(AgentInstanceBase):\n    def __init__(self, world):\n        self.world = world\n\n"
     "    async def step(self, states, **k):\n        return {}\n",
     r"Env\(\) .*its __init__\(world\) requires arguments .*give them defaults"),
])
def test_an_agent_instance_that_cannot_be_created_is_refused_at_load(tmp_path, instance, needle):
    body = instance + ("\n\nclass AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n"
                       "        super().__init__(Env)\n")
    with pytest.raises(AgentFileError, match=r"--train.agent_func_path .*agent.py: every episode "
                                             r"creates " + needle):
        load_agent_executor(write(tmp_path, body))


def test_an_agent_instance_with_default_arguments_loads(tmp_path):
    body = ("class Env(AgentInstanceBase):\n    def __init__(self, world=None, **kwargs):\n        pass\n\n"
            "    async def step(self, states, **k):\n        return {}\n\n\n"
            "class AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n        "
            "super().__init__(Env)\n")
    assert load_agent_executor(write(tmp_path, body)).agent_instance_cls.__name__ == "Env"


def test_an_openai_server_agent_without_fastapi_names_the_serve_extra(tmp_path, monkeypatch):
    from posttrain.utils.errors import UserError

    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if not installed
    body = """
        from posttrain.agents.openai_server import OpenAIServerAgentExecutor

        class AgentExecutor(OpenAIServerAgentExecutor):
            async def run_agent(self, prompt, label, session):
                return {"reward": 0.0}
        """
    path = write(tmp_path, body)
    with pytest.raises(UserError) as err:  # before the executor is built
        load_agent_executor(path)
    assert str(err.value) == (f"--train.agent_func_path {path} (an OpenAIServerAgentExecutor) needs FastAPI, "
                              "which is not installed: pip install -e '.[serve]'")
