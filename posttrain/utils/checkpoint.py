"""Atomic, verified, rotated checkpoints.

Layout: `<root>/global_step<N>/` holding whatever the writer put there plus `manifest.json`
({"step", "meta", "files": {relpath: [size, crc32]}}). A save writes into `<root>/.tmp_step<N>/`
and renames it into place only after every rank has written and the manifest is complete, so a
crash mid-save leaves the previous checkpoints untouched. Rotation (`max_num`, `max_mem_gb`) runs
only after a successful save and never deletes the newest checkpoint. Loading verifies sizes and
CRC32 of every file and falls back to the newest checkpoint that verifies.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

from posttrain.utils.errors import UserError
from posttrain.utils.log import info, warn_once

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^global_step(\d+)$")


class CheckpointError(UserError, RuntimeError):
    pass


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
    for rel, (size, crc) in files.items():
        p = path / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != size:
            return f"{p} has {p.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
        if _crc32(p) != crc:
            return f"{p} fails its CRC32 check (corrupted)"
    return None


def read_manifest(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / MANIFEST).read_text())


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, *, max_num: int = 3, max_mem_gb: float = math.inf,
                 is_main: bool = True, barrier: Callable[[], None] = lambda: None) -> None:
        if max_num < 1:
            raise ValueError(f"--ckpt.max_num must be >= 1, got {max_num}")
        self.root = Path(root)
        self.max_num = max_num
        self.max_mem_bytes = max_mem_gb * 1024**3
        self.is_main = is_main
        self.barrier = barrier

    def step_dirs(self) -> list[tuple[int, Path]]:
        """All `global_step<N>` folders, newest first (valid or not)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))]
        return sorted(found, reverse=True)

    def save(self, step: int, write: Callable[[Path], None], meta: dict) -> Path:
        """Every rank calls this; `write(tmp_dir)` runs on every rank, the rest on the main one."""
        tmp = self.root / f".tmp_step{step}"
        final = self.root / f"global_step{step}"
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.barrier()
        write(tmp)
        self.barrier()
        if self.is_main:
            manifest = {"step": step, "meta": meta, "files": _file_table(tmp)}
            with (tmp / MANIFEST).open("w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():
                old = self.root / f".old_step{step}"
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                tmp.rename(final)
            self._rotate()
        self.barrier()
        return final

    def _rotate(self) -> None:
        dirs = self.step_dirs()
        keep, drop = dirs[: self.max_num], dirs[self.max_num:]
        sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for _, p in keep}
        while len(keep) > 1 and sum(sizes[p] for _, p in keep) > self.max_mem_bytes:
            drop.append(keep.pop())
        for step, p in drop:
            info(f"checkpoint rotation: removing {p} (--ckpt.max_num {self.max_num}, --ckpt.max_mem)")
            shutil.rmtree(p, ignore_errors=True)

    def valid_checkpoints(self) -> list[tuple[int, Path]]:
        """Checkpoints that verify, newest first; each one that does not is reported once."""
        good = []
        for step, p in self.step_dirs():
            problem = verify_checkpoint(p)
            if problem is None:
                good.append((step, p))
            else:
                warn_once(f"skipping checkpoint {p}: {problem}")
        return good

    def latest(self) -> Path | None:
        valid = self.valid_checkpoints()
        return valid[0][1] if valid else None
