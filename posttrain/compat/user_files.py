"""Running a user's Python file (a reward function or an agent) as a module: OpenRLHF imports resolve
to posttrain's stand-ins (`openrlhf_modules.install`), and the file's folder is importable while it
loads so it can import its neighbours. Errors propagate as raised; callers turn them into one line."""
from __future__ import annotations

import importlib.util
import os
import sys
import types

from posttrain.compat import openrlhf_modules


def exec_user_file(path: str, prefix: str) -> types.ModuleType:
    name = prefix + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    openrlhf_modules.install()
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    return module
