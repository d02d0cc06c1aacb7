"""Claiming a run's folders at start-up, shared by every trainer (SFT/RM/DPO through `SingleModelRun`,
and the RL trainer).

    folders = claim_run_folders(cfg, is_main=...)   # before config.yaml, metrics or any model
    try:
        ...; CheckpointManager in folders.ckpt (None: no checkpoints); folders.resume_from: what to resume
    finally:
        folders.close()

`claim_run_folders` (1) locks `--ckpt.output_dir` against a second writer (main process; `RunLock`),
(2) resolves the checkpoint folder (`checkpoint_dir`: `--ckpt.path`, unset ->
`<--ckpt.output_dir>/checkpoints`) and prints it, (3) when the run uses it (`--ckpt.save_steps` > 0 or
`--ckpt.load_enable`) locks it too, with a lock of its own even inside the run directory (another run
pointed at it with `--ckpt.path` takes that folder's lock, not the run directory's), and checks it
(`CheckpointManager.prepare`): a fresh run into a folder holding checkpoints is refused; a resume
picks the newest checkpoint that verifies and refuses one written with other training flags.
Every refusal is a UserError raised before anything is written; the locks taken so far are released.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.config import TrainerConfig, adjustable_values, checkpoint_dir, run_fingerprint
from posttrain.utils.checkpoint import CheckpointManager, RunIdentity
from posttrain.utils.log import info
from posttrain.utils.run_lock import RunLock


def run_identity(cfg: TrainerConfig) -> RunIdentity:
    """This run's identity for its checkpoint manifests: a fresh run_id, the config fingerprint."""
    digest, fields = run_fingerprint(cfg)
    return RunIdentity(fingerprint=digest, fields=fields, adjustable=adjustable_values(cfg))


@dataclass
class RunFolders:
    """The folders a run has claimed: `path` (--ckpt.output_dir), the checkpoint manager, the locks."""

    path: Path
    ckpt: CheckpointManager | None = None
    resume_from: Path | None = None
    locks: list[RunLock] = field(default_factory=list)

    def last_checkpoint(self) -> Path | None:
        """The newest good checkpoint of this run (saved by it or resumed from), or None."""
        return self.ckpt.last_good if self.ckpt is not None else None

    def close(self) -> None:
        """Release the folder locks (idempotent)."""
        for lock in reversed(self.locks):
            lock.release()
        self.locks.clear()

    def __enter__(self) -> RunFolders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def claim_run_folders(cfg: TrainerConfig, *, is_main: bool = True) -> RunFolders:
    """Lock and check the run's folders before anything is written (module docstring)."""
    folders = RunFolders(Path(cfg.ckpt.output_dir))
    try:
        if is_main:
            folders.locks.append(RunLock(folders.path, "--ckpt.output_dir").acquire())
        root = checkpoint_dir(cfg)
        if root is None or not (cfg.ckpt.save_steps > 0 or cfg.ckpt.load_enable):
            return folders
        how = " (--ckpt.path unset: <--ckpt.output_dir>/checkpoints)" if cfg.ckpt.path is None else ""
        info(f"checkpoints: {root.resolve()}{how}")
        if is_main:
            folders.locks.append(RunLock(root, "--ckpt.path").acquire())
        max_mem = cfg.ckpt.max_mem if cfg.ckpt.max_mem is not None else math.inf
        folders.ckpt = CheckpointManager(root, max_num=cfg.ckpt.max_num, max_mem_gb=max_mem, is_main=is_main,
                                         identity=run_identity(cfg))
        folders.resume_from = folders.ckpt.prepare(cfg.ckpt.load_enable)
        return folders
    except BaseException:
        folders.close()
        raise
