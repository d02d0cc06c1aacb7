"""Let reward and agent files written for OpenRLHF import `openrlhf` without OpenRLHF installed.

`install()` (idempotent; posttrain calls it before loading a user's Python file) appends a finder to
the END of `sys.meta_path`. Python consults it only when no other finder found the module, so a real
`openrlhf` (installed, or a folder on sys.path, e.g. beside the user's file) always wins and is
never shadowed. When no real one exists:

- `openrlhf` is an empty stand-in package;
- `openrlhf.utils` holds `extract_boxed_answer` and `grade_answer` (posttrain.rewards.math_grading);
  importing another OpenRLHF utility from it (e.g. `get_tokenizer`) raises a clear ImportError;
- `openrlhf.utils.agent` holds the agent API of posttrain.agents.agent_api (OpenRLHF's executors and
  instance base, run by posttrain);
- any other `openrlhf.*` module raises ModuleNotFoundError saying what the stand-in covers.

The first import of each stand-in module is announced once with `posttrain.utils.log.info`, naming
the file that imported it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types

from posttrain.utils.errors import UserError
from posttrain.utils.log import info

ROOT = "openrlhf"
_MARK = "__posttrain_stand_in__"
# stand-in module -> (posttrain module it re-exports, names, is a package)
_STAND_INS = {
    "openrlhf": (None, (), True),
    "openrlhf.utils": ("posttrain.rewards.math_grading", ("extract_boxed_answer", "grade_answer"),
                       True),
    "openrlhf.utils.agent": ("posttrain.agents.agent_api",
                             ("AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor",
                              "SingleTurnAgentExecutor"), False),
}
# public OpenRLHF names of a stand-in module that posttrain does not provide
_MISSING = {"openrlhf.utils": ("get_strategy", "get_tokenizer")}
_INSTALL = "pip install openrlhf"
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.abc.__file__)) + os.sep


class OpenRLHFNameUnavailable(UserError, ImportError):
    """A user file imported an OpenRLHF name that posttrain's stand-in does not provide."""


def _covered() -> str:
    return "; ".join(f"{name} ({', '.join(names)})" for name, (_, names, _) in _STAND_INS.items() if names)


def _importer() -> str:
    """File of the innermost frame that is not the import machinery or this module."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(("<frozen", _IMPORTLIB_DIR)) or filename == __file__):
            return filename
        frame = frame.f_back
    return "a user file"


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        source, names, _ = _STAND_INS[module.__name__]
        setattr(module, _MARK, True)
        module.__doc__ = (f"posttrain's stand-in for {module.__name__} (OpenRLHF is not installed)"
                          + (f": re-exports {', '.join(names)} from {source}" if source else ""))
        if source:
            implementation = __import__(source, fromlist=list(names))
            for name in names:
                setattr(module, name, getattr(implementation, name))
        module.__all__ = list(names)
        missing = _MISSING.get(module.__name__, ())

        def __getattr__(name: str):
            if name in missing:
                raise OpenRLHFNameUnavailable(
                    f"`from {module.__name__} import {name}`: openrlhf is not installed and posttrain's "
                    f"stand-in {module.__name__} provides only {', '.join(names)}; {_INSTALL} to use {name}")
            raise AttributeError(f"module {module.__name__!r} (posttrain's stand-in) has no attribute "
                                 f"{name!r}")

        module.__getattr__ = __getattr__


class _StandInFinder(importlib.abc.MetaPathFinder):
    """Last-resort finder for `openrlhf*` (module doc)."""

    def __init__(self):
        self.announced: set[str] = set()
        self.lock = threading.Lock()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        if fullname != ROOT and not getattr(sys.modules.get(ROOT), _MARK, False):
            return None  # a real openrlhf was imported: its submodules are its own business
        if fullname not in _STAND_INS:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: openrlhf is not installed and posttrain's stand-in covers "
                f"only {_covered()}; {_INSTALL} to use {fullname}", name=fullname)
        source, names, is_package = _STAND_INS[fullname]
        if source:
            with self.lock:
                first = fullname not in self.announced
                self.announced.add(fullname)
            if first:
                info(f"openrlhf is not installed: `{fullname}` in {_importer()} resolves to posttrain's "
                     f"{source} ({', '.join(names)})")
        return importlib.machinery.ModuleSpec(fullname, _StandInLoader(), origin="posttrain stand-in",
                                              is_package=is_package)


_finder = _StandInFinder()


def install() -> None:
    """Make `openrlhf`, `openrlhf.utils`, `openrlhf.utils.agent` importable from user files when OpenRLHF
    is not installed (module doc); a real openrlhf is never shadowed. Safe to call repeatedly."""
    if _finder not in sys.meta_path:
        sys.meta_path.append(_finder)


def uninstall() -> None:
    """Remove the finder and any stand-in modules from sys.modules (for tests)."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n == ROOT or n.startswith(ROOT + ".")]:
        if getattr(sys.modules[name], _MARK, False):
            del sys.modules[name]
    _finder.announced.clear()


def is_stand_in(module: types.ModuleType) -> bool:
    """Whether `module` is one of posttrain's openrlhf stand-ins (not the real package)."""
    return bool(getattr(module, _MARK, False))


__all__ = ["OpenRLHFNameUnavailable", "install", "is_stand_in", "uninstall"]
