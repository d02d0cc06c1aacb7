"""Optional dependencies: which extra of pyproject.toml installs each one, and the one error a run gets when
the part it asked for is not installed.

The core install runs SFT / RM / DPO / PPO in one process with the HF engine; Ray, DeepSpeed, the HTTP
servers, the math grader, TensorBoard, W&B, vLLM and bitsandbytes come with extras (`make setup` installs
them all). posttrain is installed from its repository, so the fix is `pip install -e '.[extra]'`.
"""
from __future__ import annotations

import importlib.util

from posttrain.utils.errors import UserError

# import name -> (the name users know it by, the extra that installs it)
EXTRAS = {
    "ray": ("Ray", "ray"),
    "deepspeed": ("DeepSpeed", "deepspeed"),
    "fastapi": ("FastAPI", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "math_verify": ("math-verify", "math"),
    "tensorboard": ("TensorBoard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "bitsandbytes": ("bitsandbytes", "qlora"),
    "vllm": ("vLLM", "vllm"),
}


class MissingExtra(UserError, ImportError):
    """A run asked for a part whose optional dependency is not installed (one line, exit status 2)."""


def installed(module: str) -> bool:
    """Whether `module` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pip_install(extra: str) -> str:
    return f"pip install -e '.[{extra}]'"


def missing_message(module: str, what: str) -> str:
    """`"<what> needs <Name>, which is not installed: pip install -e '.[<extra>]'"`."""
    name, extra = EXTRAS[module]
    return f"{what} needs {name}, which is not installed: {pip_install(extra)}"


def require(what: str, *modules: str) -> None:
    """Raise `MissingExtra` (`missing_message`) for the first of `modules` that is not installed; `what` names
    the flag or feature that needs it (e.g. "--vllm.num_engines 2")."""
    for module in modules:
        if not installed(module):
            raise MissingExtra(missing_message(module, what))
