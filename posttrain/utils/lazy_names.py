"""A package's names imported on first use (PEP 562): `__getattr__ = lazy_names(__name__, where)` in the
package's `__init__.py`, `where` mapping each name to the submodule that defines it. Importing one light
submodule then does not import the heavy ones (torch, transformers)."""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)  # looked up once
        return value
    return __getattr__
