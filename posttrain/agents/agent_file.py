"""Loading `--train.agent_func_path`: a Python file that defines `AgentExecutor`, a subclass of
`AgentExecutorBase` (OpenRLHF's contract; usually `class AgentExecutor(MultiTurnAgentExecutor)` whose
`__init__` passes its `AgentInstance` class). The file may import `openrlhf.utils.agent`; without
OpenRLHF installed that resolves to posttrain's implementation (`openrlhf_modules`). Every problem is a
UserError naming the file, raised at start-up before any model loads, including an `AgentInstance` that
the executor could not create (an abstract method left out, an `__init__` that requires arguments)."""
from __future__ import annotations

import inspect

from posttrain.agents.agent_api import AgentExecutorBase
from posttrain.agents.openai_server import OpenAIServerAgentExecutor
from posttrain.compat.user_files import call_user, import_user_file
from posttrain.utils.errors import UserError
from posttrain.utils.extras import require

FLAG = "--train.agent_func_path"


class AgentFileError(UserError):
    pass


def load_agent_executor(path: str) -> AgentExecutorBase:
    module = import_user_file(path, FLAG, "an agent file must be a .py file defining AgentExecutor",
                              "posttrain_agent_", AgentFileError)
    cls = getattr(module, "AgentExecutor", None)
    if cls is None:
        raise AgentFileError(f"{FLAG} {path} defines no `AgentExecutor`; add e.g. `class AgentExecutor("
                             "MultiTurnAgentExecutor): def __init__(self): super().__init__(AgentInstance)`")
    if not (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)):
        raise AgentFileError(f"{FLAG} {path}: AgentExecutor must be a subclass of AgentExecutorBase "
                             "(from openrlhf.utils.agent or posttrain.agents.agent_api)")
    if issubclass(cls, OpenAIServerAgentExecutor):  # it serves the policy over HTTP
        require(f"{FLAG} {path} (an OpenAIServerAgentExecutor)", "fastapi", "uvicorn")
    try:
        executor = call_user(cls)
    except Exception as e:
        raise AgentFileError(f"{FLAG} {path}: AgentExecutor() raised {type(e).__name__}: {e}") from e
    instance_cls = getattr(executor, "agent_instance_cls", None)
    if isinstance(instance_cls, type):
        problem = _instantiation_problem(instance_cls)
        if problem:
            raise AgentFileError(f"{FLAG} {path}: every episode creates {instance_cls.__name__}() with no "
                                 f"arguments, which cannot work: {problem}")
    return executor


def _instantiation_problem(cls: type) -> str | None:
    """Why `cls()` cannot create an instance (an abstract method left out, an `__init__` that requires
    arguments), found without creating one (no environment starts at start-up); None when it can."""
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract:
        return (f"it does not implement {', '.join(abstract)} (abstract in AgentInstanceBase); define "
                + " and ".join(f"`{'async ' if name != '__init__' else ''}def {name}(self, "
                               f"...)`" for name in abstract))
    try:
        inspect.signature(cls).bind()
    except TypeError as err:
        return f"its __init__{inspect.signature(cls)} requires arguments ({err}); give them defaults"
    except ValueError:  # no signature to read
        pass
    return None
