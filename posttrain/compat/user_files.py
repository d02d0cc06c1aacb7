"""Running a user's Python file (a reward function or an agent) as a module: OpenRLHF imports resolve
to posttrain's stand-ins (`openrlhf_modules.install`), and the file's folder is importable while it
loads so it can import its neighbours. Errors propagate as raised; callers turn them into one line.

A user file is code that runs with the run's permissions. `sys.exit()` in it (a `SystemExit`, while
it loads or when posttrain calls it) must not end the run silently with the file's exit status:
`exec_user_file` and `call_user` turn it into `UserFileExit`, an ordinary exception that the callers
report as an error of the file. While a file loads, `os._exit()` (which would end the process at once,
with no error and no model) raises the same way in the loading thread; other threads and forked
children exit as usual."""
from __future__ import annotations

import importlib.util
import os
import posix
import sys
import threading
import traceback
import types

import posttrain
from posttrain.compat import openrlhf_modules

_POSTTRAIN_DIR = os.path.dirname(os.path.abspath(posttrain.__file__)) + os.sep


class _ProcessExit(SystemExit):
    """`os._exit(code)` called while a user file loads."""

    how = "os._exit"


_REAL_EXIT = posix._exit  # captured once: a concurrent load never restores a patched function
_loading: dict[tuple[int, int], int] = {}  # (pid, thread id) -> nested loads in that thread
_loading_lock = threading.Lock()


def _raise_process_exit(code: int = 0):
    """Raises `_ProcessExit` in a thread that is loading a user file; every other thread, and a child
    forked while a file loads (e.g. a multiprocessing fork child), exits for real."""
    if (os.getpid(), threading.get_ident()) in _loading:
        raise _ProcessExit(code)
    _REAL_EXIT(code)


class UserFileExit(RuntimeError):
    """A user's file raised SystemExit (`sys.exit(code)`, `exit()`, `quit()`); the traceback is the
    SystemExit's, so the caller's report points at the user's line."""

    def __init__(self, err: SystemExit) -> None:
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if not f.filename.startswith("<")
                  and not os.path.abspath(f.filename).startswith(_POSTTRAIN_DIR)]
        at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        how = getattr(err, "how", "sys.exit")
        super().__init__(f"it called {how}({err.code!r}){at}; a reward or agent file must raise an exception "
                         "(or return) instead of exiting the process")
        self.code = err.code


def exiting(err: SystemExit) -> UserFileExit:
    """`UserFileExit` for `err`, carrying its traceback."""
    return UserFileExit(err).with_traceback(err.__traceback__)


def call_user(fn, *args, **kwargs):
    """fn(*args, **kwargs), with a SystemExit raised by it turned into UserFileExit."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as err:
        raise exiting(err) from None


def exec_user_file(path: str, prefix: str) -> types.ModuleType:
    name = prefix + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(os.path.abspath(path))
    openrlhf_modules.install()
    sys.path.insert(0, folder)
    key = (os.getpid(), threading.get_ident())
    with _loading_lock:
        _loading[key] = _loading.get(key, 0) + 1
        os._exit = posix._exit = _raise_process_exit
    try:
        spec.loader.exec_module(module)
    except SystemExit as err:
        raise exiting(err) from None
    finally:
        with _loading_lock:
            _loading[key] -= 1
            if not _loading[key]:
                del _loading[key]
            if not _loading:
                os._exit = posix._exit = _REAL_EXIT
        if sys.path and sys.path[0] == folder:
            sys.path.pop(0)
    return module


def import_user_file(path: str, flag: str, must_be: str, prefix: str,
                     error: type[Exception]) -> types.ModuleType:
    """The module of the user's file `path` given to `flag` (`exec_user_file`); `error` with one line naming
    the flag and the file when it is not a .py file (`must_be` says what it must be), does not exist, or
    importing it raised."""
    if not str(path).endswith(".py"):
        raise error(f"{flag} {path}: {must_be}")
    if not os.path.isfile(path):
        raise error(f"{flag} {path}: file not found (resolved to {os.path.abspath(path)})")
    try:
        return exec_user_file(path, prefix)
    except Exception as e:
        cause = " ".join(str(e).split())
        raise error(f"{flag} {path}: importing it raised {type(e).__name__}: {cause}") from e
