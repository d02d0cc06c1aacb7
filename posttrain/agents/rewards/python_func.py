"""A reward function in a Python file (`--reward.remote_url path/to/reward.py`), OpenRLHF-compatible.

The file defines `reward_func(queries, prompts, labels, **kwargs)`: queries are the B prompt+response
texts, prompts the B prompt texts, labels the B ground-truth labels (the dataset's `--data.label_key`
field). It returns `{"rewards": B numbers, "scores": B numbers (optional, default rewards),
"extra_logs": {name: number or B numbers} (optional)}` — numbers as a torch tensor, numpy array,
list or tuple — or just the B rewards as a bare sequence. It is called once per rollout batch.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import traceback

from posttrain.agents.rewards.result import (
    ON_ERROR,
    RewardError,
    RewardResult,
    check_batch,
    parse_output,
    skipped_batch,
)
from posttrain.utils.log import warn_once

FLAG = "--reward.remote_url"


def _load_function(path: str):
    if not path.endswith(".py"):
        raise ValueError(f"{FLAG}={path!r}: a reward function file must end in .py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{FLAG}={path!r}: reward function file not found "
                                f"(resolved to {os.path.abspath(path)})")
    name = "posttrain_reward_func_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # let the file import its neighbours while it loads
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        where = traceback.extract_tb(err.__traceback__)[-1]
        raise RewardError(f"importing reward function file {path} raised {type(err).__name__}: {err} "
                          f"(at {where.filename}:{where.lineno})") from err
    finally:
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    fn = getattr(module, "reward_func", None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(f"reward function file {path} defines no `reward_func` (it defines: "
                          f"{', '.join(defined) or 'nothing callable'}); add "
                          "`def reward_func(queries, prompts, labels, **kwargs)`")
    if not callable(fn):
        raise RewardError(f"reward function file {path}: `reward_func` is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind([], [], [])
    except TypeError as err:
        raise RewardError(f"reward function file {path}: reward_func{inspect.signature(fn)} cannot be called as "
                          f"reward_func(queries, prompts, labels) ({err})") from None
    except ValueError:  # builtins without a signature
        pass
    return fn


class PythonRewardFunction:
    """RewardSource calling `reward_func` from a Python file, once per batch.

    on_error: "raise" (default) → a raising function or an invalid return raises RewardError naming the
    file and the problem. "skip" → the affected samples (all of the batch when the function raised or
    returned the wrong shape; single samples for non-finite values) are marked `skipped` with reward 0,
    counted in `num_skipped` and reported with a warning. `labels=None` is passed as B `None`s. kwargs
    reach the function when it accepts them (by name, or all with `**kwargs`)."""

    def __init__(self, path, on_error: str = "raise"):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: valid values are {list(ON_ERROR)}")
        self.path = os.fspath(path)
        self.on_error = on_error
        self.fn = _load_function(self.path)
        self._params = _accepted_kwargs(self.fn)
        self.origin = f"reward function {self.path}"
        self.num_calls = 0
        self.num_samples = 0
        self.num_skipped = 0

    def score(self, queries, prompts, labels=None, **kwargs) -> RewardResult:
        n = check_batch(queries, prompts, labels)
        labels = [None] * n if labels is None else labels
        extra = kwargs if self._params is None else {k: v for k, v in kwargs.items() if k in self._params}
        self.num_calls += 1
        self.num_samples += n
        try:
            raw = self.fn(list(queries), list(prompts), list(labels), **extra)
        except Exception as err:
            where = traceback.extract_tb(err.__traceback__)[-1]
            msg = f"{self.origin} raised {type(err).__name__}: {err} (at {where.filename}:{where.lineno})"
            if self.on_error == "raise":
                raise RewardError(msg) from err
            result = skipped_batch(n, msg)
        else:
            result = parse_output(raw, n, self.origin, self.on_error)
        if result.num_skipped:
            self.num_skipped += result.num_skipped
            warn_once(f"skipped {result.num_skipped}/{n} samples (on_error=skip): {result.skip_reasons[0]}")
        return result

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"PythonRewardFunction({self.path!r}, on_error={self.on_error!r})"


def _accepted_kwargs(fn) -> set[str] | None:
    """Keyword names `fn` accepts beyond (queries, prompts, labels); None when it takes **kwargs."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except ValueError:
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
