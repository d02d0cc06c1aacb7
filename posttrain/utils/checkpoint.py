"""Atomic, verified, rotated checkpoints that belong to one run.

Layout: `<root>/global_step<N>/` holding whatever the writer put there plus `manifest.json`
({"step", "meta", "run", "files": {relpath: [size, crc32]}}). "run" is the writer's `RunIdentity`:
{"run_id": the run lineage (a resumed run keeps the id of what it resumed), "fingerprint": digest of
the flags that decide the training trajectory, "fields": those flags' values, "adjustable": the
values of flags that may change on resume (run length, execution)}.

Contract of `CheckpointManager`:
- `prepare(resume)` runs before any model loads. A fresh run (`resume=False`) into a folder that
  already holds checkpoints is refused (CheckpointError: the folder, the steps, the two fixes).
  With `resume=True` the newest checkpoint that verifies is chosen; when its fingerprint differs
  from this run's, CheckpointError names the checkpoint and every differing flag — there is no
  fallback to an older checkpoint or another run's. The run then takes the checkpoint's run_id.
- `save` writes into `<root>/.tmp_step<N>/` and renames it into place only after every rank has
  written and the manifest is complete. Any failure or interrupt (Ctrl-C) during a save removes the
  temp folder and keeps every earlier checkpoint; a full disk (ENOSPC, EDQUOT, EFBIG) ends in a
  CheckpointError naming the step, the folder and the last good checkpoint.
- Rotation (`max_num`, `max_mem_gb`) runs after a successful save, considers only checkpoints of
  this run (same run_id; all of them when the manager has no identity) and never deletes the
  checkpoint just written. It deletes checkpoints without a metric first, then the worst metric, then
  the oldest (as OpenRLHF): a checkpoint's metric is `meta["metric"]` = {"key", "value",
  "higher_is_better"} (None: not evaluated).
- `save(..., best=True)` writes `<root>/best_global_step<N>/` the same way and then removes this run's
  earlier best one; best checkpoints are never rotated and not counted by `max_num` / `max_mem_gb`.
  They are resumable: resume takes the newest checkpoint of either kind (a regular one at equal steps).
- `save_export(name, write)` writes `<root>/<name>/` (an HF export) atomically, outside rotation.
- Loading verifies sizes and CRC32 of every file (`verify_checkpoint`); a checkpoint holding a file
  its manifest does not list fails verification (only files its writer wrote are ever loaded).
  posttrain's own state files (`save_state_file` / `load_state_file`) hold tensors and plain values
  and are read with `torch.load(weights_only=True)`: a file holding any other object is refused
  (CheckpointError naming the file), never unpickled. DeepSpeed's engine files are unpickled by
  DeepSpeed: checkpoints must come from a trusted source, and `prepare(resume=True)` resumes only a
  checkpoint whose manifest records a run id (one a posttrain run wrote).
Multi-rank: every rank calls `prepare` and `save`; only the main one creates, renames and deletes
folders. A rank that fails inside `write` while the others reach the barrier leaves them waiting
(the usual disk-full case, one shared disk, fails on every rank).
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.utils.errors import UserError
from posttrain.utils.log import info, warn_once

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^global_step(\d+)$")
_BEST_DIR = re.compile(r"^best_global_step(\d+)$")
_OLD_DIR = re.compile(r"^\.old_step(\d+)$")  # a checkpoint being replaced by a new save of its step
_LEFTOVER = re.compile(r"^\.(tmp_.+|del_.+|old_best.+)$")  # a save, an export or a deletion cut short
_DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
              errno.EFBIG: "file too large for the file system"}


class CheckpointError(UserError, RuntimeError):
    pass


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class RunIdentity:
    """Who writes a checkpoint folder. `fingerprint` digests `fields` (the flags that decide the
    training trajectory); `adjustable` holds flags that may differ on resume (named in a note);
    `run_id` names the lineage: a fresh run draws one, a resumed run takes its checkpoint's."""

    fingerprint: str
    fields: dict[str, Any] = field(default_factory=dict)
    adjustable: dict[str, Any] = field(default_factory=dict)
    run_id: str = field(default_factory=new_run_id)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_show(v) for v in value) or "[]"
    if isinstance(value, str):
        return repr(value) if (not value or any(c.isspace() for c in value)) else value
    return str(value)


def flag_diffs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`--flag: checkpoint A, this run B` for every flag both sides record with different values
    (a flag only one side knows — another posttrain version — is not a difference)."""
    out = []
    for key, now in current.items():
        if key in saved and saved[key] != now:
            name = key if key == "trainer" else f"--{key}"
            out.append(f"{name}: checkpoint {_show(saved[key])}, this run {_show(now)}")
    return out


LOW_SPACE_BYTES = 1 << 20  # a write that failed with less free space than this failed for lack of space


def disk_full_reason(exc: BaseException, folder: str | os.PathLike | None = None) -> str | None:
    """'no space left on device' (or the quota / file-size variant) when `exc`, or an exception it
    was raised from, is an OSError with such an errno; or, whatever the exception says, when `folder`
    (the write's target; its nearest existing parent) has less than LOW_SPACE_BYTES free. None
    otherwise. The free-space test is what catches writers that lose the errno: torch.save reports a
    full disk as a RuntimeError (`file write failed`, `basic_ios::clear: iostream error`, `unexpected
    pos`), safetensors as a SafetensorError. Call it before removing what the failed write left."""
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return _DISK_FULL[e.errno]
        e = e.__cause__ or e.__context__
    if folder is not None and isinstance(exc, Exception) and free_bytes(folder) < LOW_SPACE_BYTES:
        return _DISK_FULL[errno.ENOSPC]
    return None


@contextmanager
def disk_full_as_error(what: str, folder: str | os.PathLike, last_good: Path | None) -> Iterator[None]:
    """A write of `what` into `folder` (the final model) that fails for lack of space ends in one
    CheckpointError naming the folder, the cause and the last good checkpoint (which stays)."""
    try:
        yield
    except Exception as e:
        reason = disk_full_reason(e, folder)
        if reason is None:
            raise
        raise CheckpointError(
            f"{reason} while writing {what} to {folder}; the last good checkpoint is "
            f"{last_good if last_good is not None else 'none'} (free space, then resume with "
            f"--ckpt.load_enable or run again)") from e


def free_bytes(folder: str | os.PathLike) -> float:
    """Bytes free to this user on the file system of `folder` (or of its nearest existing parent);
    infinite when that cannot be told."""
    p = Path(folder).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return math.inf


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _file_table(root: Path) -> dict[str, list[int]]:
    table = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            table[p.relative_to(root).as_posix()] = [p.stat().st_size, _crc32(p)]
    return table


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """Return None when the checkpoint at `path` is complete and intact, else what is wrong."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the save did not finish)"
    try:
        data = json.loads(manifest.read_text())
        files = data["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return f"{manifest} is unreadable ({e})"
    listed = set(files)
    for p in sorted(path.rglob("*")):
        if p.is_file() and p.name != MANIFEST and p.relative_to(path).as_posix() not in listed:
            return f"{p} is not listed in {manifest} (added after the save)"
    for rel, (size, crc) in files.items():
        p = path / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != size:
            return f"{p} has {p.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
        if _crc32(p) != crc:
            return f"{p} fails its CRC32 check (corrupted)"
    return None


def save_state_file(state: dict, path: str | os.PathLike) -> None:
    """Write trainer state (tensors, dicts, lists, tuples, str, int, float, bool, None only)."""
    import torch

    torch.save(state, path)


def refused_file(path, err: BaseException) -> CheckpointError:
    """The one-line error for a file `torch.load(weights_only=True)` refused (`err`): it names the file
    and what torch refused (e.g. `Unsupported global: GLOBAL io.open`), not torch's advice."""
    found = re.search(r"Unsupported .*?(?= was not|\.\s|\.$|$)", str(err), re.MULTILINE)
    what = found.group(0) if found else "refused by torch.load(weights_only=True)"
    return CheckpointError(
        f"checkpoint file {path} holds objects other than tensors and plain values ({what}); it was not "
        f"loaded and nothing in it ran: use only checkpoints written by posttrain or DeepSpeed, from a "
        f"trusted source")


def load_state_file(path: str | os.PathLike) -> dict:
    """Read a `save_state_file` file (or an engine's model.pt / optimizer.pt) with
    `torch.load(weights_only=True)`: nothing in it can run code. A file holding other objects (an older
    posttrain's, or a crafted one) raises `refused_file`'s CheckpointError before anything in it runs."""
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of a file it then refuses
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise refused_file(path, err) from None


def run_folder_at(path: str | os.PathLike) -> Path | None:
    """The nearest folder at or above `path` that belongs to a posttrain run: a checkpoint (it holds a
    manifest.json with a file table) or a folder a run locks (checkpoint root, run output folder: it holds
    `.posttrain.lock`); None when there is none."""
    from posttrain.utils.run_lock import LOCK_FILE

    p = Path(path).absolute()
    for folder in (p, *p.parents):
        if (folder / LOCK_FILE).exists():
            return folder
        try:
            if isinstance(read_manifest(folder).get("files"), dict):
                return folder
        except (OSError, ValueError, AttributeError):
            pass
    return None


def read_manifest(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


def _run_id_of(path: Path) -> str | None:
    try:
        return (read_manifest(path).get("run") or {}).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def checkpoint_metric(path: Path) -> dict | None:
    """The evaluation metric a checkpoint was saved with ({"key", "value", "higher_is_better"}), or None (also
    for a non-finite value, which cannot be ranked: such a checkpoint is rotated out first)."""
    try:
        m = read_manifest(path)["meta"].get("metric")
        ok = m and isinstance(m.get("value"), (int, float)) and math.isfinite(m["value"])
        return m if ok else None
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None


def _eviction_order(metric: dict | None, step: int) -> tuple:
    """Sort key of rotation: no metric first, then the worst value (by its direction), then the oldest."""
    if metric is None:
        return (0, 0.0, step)
    return (1, metric["value"] if metric.get("higher_is_better", True) else -metric["value"], step)


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, *, max_num: int = 3, max_mem_gb: float = math.inf,
                 is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                 identity: RunIdentity | None = None) -> None:
        if max_num < 1:
            raise ValueError(f"--ckpt.max_num must be >= 1, got {max_num}")
        self.root = Path(root)
        self.max_num = max_num
        self.max_mem_bytes = max_mem_gb * 1024**3
        self.is_main = is_main
        self.barrier = barrier
        self.identity = identity
        self.last_good: Path | None = None  # newest good checkpoint of this run: saved or resumed from
        self._prepared: tuple[bool, Path | None] | None = None

    def step_dirs(self) -> list[tuple[int, Path]]:
        """All checkpoint folders, newest first (valid or not): `global_step<N>`, and `.old_step<N>`
        where a crash mid-replacement left it without its `global_step<N>`."""
        if not self.root.is_dir():
            return []
        found: dict[int, Path] = {}
        old: dict[int, Path] = {}
        for p in self.root.iterdir():
            if m := _STEP_DIR.match(p.name):
                found[int(m.group(1))] = p
            elif m := _OLD_DIR.match(p.name):
                old[int(m.group(1))] = p
        for step, p in old.items():
            found.setdefault(step, p)
        return sorted(found.items(), reverse=True)

    def best_dirs(self) -> list[tuple[int, Path]]:
        """Best checkpoints (`best_global_step<N>`), newest first (valid or not)."""
        if not self.root.is_dir():
            return []
        return sorted(((int(m.group(1)), p) for p in self.root.iterdir() if (m := _BEST_DIR.match(p.name))),
                      reverse=True)

    # ---- before the run -------------------------------------------------------------------
    def prepare(self, resume: bool) -> Path | None:
        """Check the folder before any model loads and return the checkpoint to resume (None: start
        fresh). The first call's answer is kept. Removes temp folders of interrupted saves (call it
        only while holding the folder's lock, see `posttrain.utils.run_lock`)."""
        if self._prepared is not None:
            return self._prepared[1]
        if self.is_main and self.root.is_dir():
            for p in self.root.iterdir():
                if _LEFTOVER.match(p.name):
                    shutil.rmtree(p, ignore_errors=True)
        found = sorted(self.step_dirs() + self.best_dirs(), reverse=True)
        path = None
        if not resume:
            if found:
                steps = [str(s) for s, _ in reversed(found)]
                shown = ", ".join(steps if len(steps) <= 8 else [*steps[:3], "...", *steps[-3:]])
                raise CheckpointError(
                    f"--ckpt.path {self.root} already holds checkpoints (steps {shown}) of an earlier run; "
                    f"pass --ckpt.load_enable to resume it, or choose another (or empty) --ckpt.path")
        else:
            valid = self.valid_checkpoints()
            if valid:
                path = valid[0][1]
                self._adopt(path)
                self.last_good = path
            else:
                info(f"--ckpt.load_enable: no valid checkpoint in {self.root}; starting fresh")
        self._prepared = (resume, path)
        return path

    def _adopt(self, path: Path) -> None:
        """Refuse `path` when its manifest records no run (no run_id: DeepSpeed would unpickle engine
        files of unknown origin) or when its training flags differ from this run's; else take its run_id."""
        if self.identity is None:
            return
        run = read_manifest(path).get("run")
        if not run or not run.get("run_id"):
            raise CheckpointError(
                f"cannot resume from checkpoint {path}: its manifest records no posttrain run id (written by "
                f"a posttrain older than run ids, or not by posttrain), and DeepSpeed unpickles engine files "
                f"when loading them; posttrain resumes only checkpoints a posttrain run wrote. Start a new "
                f"run with another --ckpt.path")
        if run.get("fingerprint") != self.identity.fingerprint:
            diffs = flag_diffs(run.get("fields") or {}, self.identity.fields)
            if diffs:
                raise CheckpointError(
                    f"cannot resume from checkpoint {path}: it was written with other training flags "
                    f"({'; '.join(diffs)}); resume with the flags it was written with, or start a new run "
                    f"with another --ckpt.path")
        for diff in flag_diffs(run.get("adjustable") or {}, self.identity.adjustable):
            info(f"note: resuming {path.name} with a changed run-length/execution flag: {diff}")
        self.identity.run_id = run.get("run_id") or self.identity.run_id

    # ---- saving ----------------------------------------------------------------------------
    def save(self, step: int, write: Callable[[Path], None], meta: dict, best: bool = False) -> Path:
        """Every rank calls this; `write(tmp_dir)` runs on every rank, the rest on the main one.
        `best`: the run's best checkpoint (`best_global_step<N>`, replaces its earlier one, no rotation)."""
        tmp = self.root / (f".tmp_best_step{step}" if best else f".tmp_step{step}")
        final = self.root / (f"best_global_step{step}" if best else f"global_step{step}")
        try:
            if self.is_main:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            self.barrier()
            write(tmp)
            self.barrier()
            if self.is_main:
                manifest = {"step": step, "meta": meta,
                            "run": asdict(self.identity) if self.identity is not None else None,
                            "files": _file_table(tmp)}
                with (tmp / MANIFEST).open("w") as f:
                    json.dump(manifest, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
                old = self.root / (f".old_best_step{step}" if best else f".old_step{step}")
                self._publish(tmp, final, old)
        except BaseException as e:
            reason = disk_full_reason(e, tmp)  # before the partial folder's space is freed
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if reason is None:
                raise
            last = self._last_good()
            raise CheckpointError(
                f"{reason} while writing checkpoint step {step} to {self.root}; the last good checkpoint is "
                f"{last if last is not None else 'none'} (free space or lower --ckpt.max_num)") from e
        self.last_good = final
        if self.is_main and best:
            for _, p in self.best_dirs():
                if p != final and self._owned(p):
                    info(f"removing the earlier best checkpoint {p}")
                    self._delete(p)
        elif self.is_main:
            self._rotate(final)
        self.barrier()
        return final

    def save_export(self, name: str, write: Callable[[Path], None]) -> Path:
        """Write `<root>/<name>/` (an HF export; not a checkpoint, never rotated) atomically: `write(tmp)` on
        every rank, then the main rank renames it into place (replacing an earlier one). A failure removes the
        temp folder; a full disk ends in a CheckpointError naming the folder and the last good checkpoint."""
        tmp, final = self.root / f".tmp_{name}", self.root / name
        try:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            self.barrier()
            write(tmp)
            self.barrier()
            if self.is_main:
                self._publish(tmp, final, self.root / f".del_{name}")
        except BaseException as e:
            reason = disk_full_reason(e, tmp)
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if reason is None:
                raise
            raise CheckpointError(
                f"{reason} while writing the HF export {final}; the last good checkpoint is "
                f"{self._last_good() or 'none'} (free space, or drop --ckpt.save_hf)") from e
        self.barrier()
        return final

    def _publish(self, tmp: Path, final: Path, old: Path) -> None:
        """Rename `tmp` to `final`; an existing `final` waits as `old` until the rename is done."""
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        try:
            tmp.rename(final)
        except BaseException:
            if old.exists() and not final.exists():
                old.rename(final)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def _owned(self, path: Path) -> bool:
        return self.identity is None or _run_id_of(path) == self.identity.run_id

    def _last_good(self) -> Path | None:
        if self.last_good is not None and self.last_good.is_dir():
            return self.last_good
        return next((p for _, p in self.valid_checkpoints() if self._owned(p)), None)

    def _rotate(self, just_written: Path) -> None:
        """Delete this run's regular checkpoints beyond `max_num` / `max_mem_bytes`: those without a metric
        first, then the worst metric, then the oldest; never `just_written`."""
        ours = [(s, p) for s, p in self.step_dirs() if p != just_written and self._owned(p)]
        kept = [just_written, *(p for _, p in ours)]
        sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in kept}
        metrics = {p: checkpoint_metric(p) for p in kept}
        for _, p in sorted(ours, key=lambda sp: _eviction_order(metrics[sp[1]], sp[0])):
            if len(kept) <= self.max_num and sum(sizes[q] for q in kept) <= self.max_mem_bytes:
                break
            kept.remove(p)
            m = metrics[p]
            why = "no metric" if m is None else f"{m['key']} {m['value']:.4g}, the worst kept"
            info(f"checkpoint rotation: removing {p} ({why}; --ckpt.max_num {self.max_num}, --ckpt.max_mem)")
            self._delete(p)

    @staticmethod
    def _delete(p: Path) -> None:
        trash = p.with_name(f".del_{p.name}")  # renamed first: an interrupted delete leaves no half one
        p.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)

    # ---- reading ---------------------------------------------------------------------------
    def valid_checkpoints(self) -> list[tuple[int, Path]]:
        """Checkpoints (regular and best) that verify, newest first; each one that does not is reported
        once."""
        good = []
        # newest first; at equal steps a regular checkpoint before the best one (the same state)
        every = sorted([(s, 1, p) for s, p in self.step_dirs()] + [(s, 0, p) for s, p in self.best_dirs()],
                       reverse=True)
        for step, _, p in every:
            problem = verify_checkpoint(p)
            if problem is None:
                good.append((step, p))
            else:
                warn_once(f"skipping checkpoint {p}: {problem}")
        return good

    def latest(self) -> Path | None:
        valid = self.valid_checkpoints()
        return valid[0][1] if valid else None
