"""One writer per run directory: an exclusive `fcntl.flock` on `<dir>/.posttrain.lock`.

    with RunLock(run_dir, "--ckpt.output_dir"):   # or lock = RunLock(...).acquire(); lock.release()
        ...write config.yaml, metrics.jsonl, checkpoints, the model...

Contract: `acquire` creates the folder if needed and takes the lock without waiting; when another
process holds it, it raises `RunDirInUse` (a UserError): `<flag> <dir> is in use by another
posttrain run (pid N, started T); wait for it or choose another <flag>`. A folder that cannot be
created or written (a file of that name, a read-only file system, no permission) raises
`RunDirUnusable` (a UserError) naming the flag, the path, the cause and the fix. The holder writes its pid,
host and start time into the lock file for that message. The kernel drops a flock when its holder
dies (also on `kill -9`), so a stale lock file never blocks; the file itself stays (deleting it
would race with a process that just opened it). Forked children (DataLoader workers) share the
lock while they live. The lock belongs to a process, which runs one training at a time: a second
`RunLock` on the same folder in the same process takes it over from the first (a run object left
behind by an exception between set-up and training must not block the next run in a notebook or a
test session).
"""
from __future__ import annotations

import errno
import json
import os
import socket
import time
from pathlib import Path

from posttrain.utils.errors import UserError

LOCK_FILE = ".posttrain.lock"
_HELD: dict[str, RunLock] = {}  # realpath of a folder -> the lock this process holds on it


class RunDirInUse(UserError):
    """Another live posttrain process writes into the folder."""


class RunDirUnusable(UserError):
    """The folder cannot be created or written (a file is in the way, read-only, no permission)."""


def _unusable(flag: str, directory: Path, err: OSError) -> RunDirUnusable:
    """The one-line reason why `directory` cannot be a run folder, from the OSError that said so."""
    blocker = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        what = "is a file" if blocker == directory else f"lies under {blocker}, which is a file"
        return RunDirUnusable(f"{flag} {directory} {what}, not a folder; choose a folder path for {flag}")
    cause = {errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
             errno.EPERM: "permission denied"}.get(err.errno, err.strerror or str(err))
    return RunDirUnusable(f"{flag} {directory} cannot be written ({cause}); choose a writable folder for "
                          f"{flag}")


def lock_owner(directory: str | os.PathLike) -> dict:
    """What the lock file of `directory` says about its (last) holder: pid, host, started; {} if unknown."""
    try:
        data = json.loads((Path(directory) / LOCK_FILE).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class RunLock:
    def __init__(self, directory: str | os.PathLike, flag: str = "--ckpt.output_dir") -> None:
        self.directory = Path(directory)
        self.flag = flag
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        import fcntl

        if self._fd is not None:
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _unusable(self.flag, self.directory, e) from None
        key = os.path.realpath(self.directory)
        earlier = _HELD.pop(key, None)
        if earlier is not None:  # this process's own, left behind: take it over
            earlier.release()
        try:
            fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _unusable(self.flag, self.directory, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirInUse(self._busy_message()) from None
        except BaseException:
            os.close(fd)
            raise
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        _HELD[key] = self
        return self

    def _busy_message(self) -> str:
        owner = lock_owner(self.directory)
        parts = [f"pid {owner.get('pid', 'unknown')}"]
        if owner.get("host") and owner["host"] != socket.gethostname():
            parts[0] += f" on {owner['host']}"
        if owner.get("started"):
            parts.append(f"started {owner['started']}")
        return (f"{self.flag} {self.directory} is in use by another posttrain run ({', '.join(parts)}); "
                f"wait for it or choose another {self.flag}")

    def release(self) -> None:
        """Drop the lock (idempotent). Closing the descriptor releases the flock."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            key = os.path.realpath(self.directory)
            if _HELD.get(key) is self:
                del _HELD[key]
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a run object dropped without close() must not keep its folder locked
        try:
            self.release()
        except Exception:  # at interpreter exit module globals may be gone; the OS frees the lock anyway
            pass
