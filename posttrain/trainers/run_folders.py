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
Before all that, (0) a finished run in `--ckpt.output_dir` (its `summary.json`, or a saved model:
config.json or adapter_config.json beside weights) is refused unless `--ckpt.overwrite`, or
`--ckpt.load_enable` with checkpoints in the checkpoint folder (which resumes, or starts fresh when none
verifies, as before) that are that run's own: the folder is inside `--ckpt.output_dir` or is the
`--ckpt.path` its config.yaml records (another run's checkpoints would replace it).
Every refusal is a UserError raised before anything is written; the locks taken so far are released.
`RunFolders.abandon()` (a start that fails before training) removes what the claim and the start
created in these folders and nothing else: in a folder that existed before, only the run's own files
(`RUN_FILES`) that appeared since the claim, and the run files the start replaced (config.yaml,
metrics.jsonl, ...) get their earlier bytes back; a folder the claim made is removed whole.
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.compat.trl_grpo import REPORT_FILES as TRL_REPORT_FILES
from posttrain.config import TrainerConfig, adjustable_values, checkpoint_dir, run_fingerprint
from posttrain.utils.checkpoint import CheckpointManager, RunIdentity
from posttrain.utils.errors import UserError
from posttrain.utils.log import info
from posttrain.utils.run_lock import LOCK_FILE, RunLock

# what a run writes into its folders before training begins (the start: lock, config, metric sinks)
RUN_FILES = (LOCK_FILE, "config.yaml", *sorted(set(TRL_REPORT_FILES.values())), "metrics.jsonl", "plots",
             "summary.json")


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
    # each folder this process locked: (it, the entries it held before, the folders its lock made)
    found: list[tuple[Path, set[str] | None, list[Path]]] = field(default_factory=list)
    kept: dict[Path, bytes] = field(default_factory=dict)  # the run files found at the claim, as they were

    def last_checkpoint(self) -> Path | None:
        """The newest good checkpoint of this run (saved by it or resumed from), or None."""
        return self.ckpt.last_good if self.ckpt is not None else None

    def close(self) -> None:
        """Release the folder locks (idempotent)."""
        for lock in reversed(self.locks):
            lock.release()
        self.locks.clear()

    def abandon(self) -> None:
        """A start that failed before training: remove the run files (`RUN_FILES`) that appeared in the
        locked folders since the claim (everything in a folder the claim made), each folder this run made
        (and the parents made for it) when empty, put back the run files it replaced, then release the
        locks. Other entries (another process's, the user's) are left as they are."""
        for folder, before, made in reversed(self.found):
            if not folder.is_dir():
                continue
            new = set(os.listdir(folder)) - (before or set())
            for name in sorted(new if before is None else new & set(RUN_FILES)):
                entry = folder / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            for path in made:  # innermost first; one that something else filled meanwhile stays
                try:
                    path.rmdir()
                except OSError:
                    break
        for path, data in self.kept.items():
            path.write_bytes(data)
        self.found.clear()
        self.kept.clear()
        self.close()

    def __enter__(self) -> RunFolders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _entries(folder: Path) -> set[str] | None:
    return set(os.listdir(folder)) if folder.is_dir() else None


def _lock(folders: RunFolders, folder: Path, flag: str) -> None:
    """Lock `folder` (made if missing), noting for `abandon` what it held before, or which folders the
    lock makes (it and its missing parents, innermost first)."""
    made = []
    for path in (folder, *folder.absolute().parents):
        if path.exists():
            break
        made.append(path)
    before = _entries(folder) if not made else None
    folders.locks.append(RunLock(folder, flag).acquire())
    for name in set(RUN_FILES) & (before or set()):
        if (folder / name).is_file() and not (folder / name).is_symlink():
            folders.kept[folder / name] = (folder / name).read_bytes()
    folders.found.append((folder, before, made))


def finished_run(folder: Path) -> str | None:
    """What shows that `folder` holds a finished run: its summary.json or a saved model; None if nothing."""
    names = _entries(folder) or set()
    if "summary.json" in names:
        return "summary.json"
    weights = any(n.endswith((".safetensors", ".bin")) for n in names)
    if weights and names & {"config.json", "adapter_config.json"}:
        return "a saved model"
    return None


def _refuse_finished(cfg: TrainerConfig, folder: Path, how: str | None = None) -> None:
    """UserError when `folder` holds a finished run and --ckpt.overwrite is not given; `how`: why resuming
    does not count (default: it was not asked for, or there is nothing to resume)."""
    what = None if cfg.ckpt.overwrite else finished_run(folder)
    if what:
        how = how or (" and --ckpt.load_enable has no checkpoint to resume;" if cfg.ckpt.load_enable else
                      "; resume its checkpoints with --ckpt.load_enable,")
        raise UserError(f"--ckpt.output_dir {folder} holds a finished run ({what}){how} replace it with "
                        "--ckpt.overwrite, or choose another --ckpt.output_dir")


def _foreign_checkpoints(folder: Path, root: Path) -> str | None:
    """Why the checkpoints in `root` are not those of the run in `folder`, or None when they are: `root` is
    inside `folder`, or is the --ckpt.path that `folder`'s config.yaml records."""
    import yaml

    if root.resolve().is_relative_to(folder.resolve()):
        return None
    try:
        recorded = yaml.safe_load((folder / "config.yaml").read_text())["ckpt"]["path"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        recorded = None
    if recorded and Path(recorded).resolve() == root.resolve():
        return None
    return f" and --ckpt.path {root} is not its checkpoint folder (resuming another run's would replace it);"


def refuse_finished_run(cfg: TrainerConfig) -> None:
    """Step (0) of `claim_run_folders` alone, locking and writing nothing: UserError when --ckpt.output_dir
    holds a finished run, unless --ckpt.overwrite, or --ckpt.load_enable with that run's own checkpoints to
    resume (`_foreign_checkpoints`)."""
    folder, root = Path(cfg.ckpt.output_dir), checkpoint_dir(cfg)
    if cfg.ckpt.load_enable and root is not None and any(root.glob("global_step*")):
        foreign = _foreign_checkpoints(folder, root)
        if foreign:
            _refuse_finished(cfg, folder, foreign)
        return
    _refuse_finished(cfg, folder)


def claim_run_folders(cfg: TrainerConfig, *, is_main: bool = True) -> RunFolders:
    """Lock and check the run's folders before anything is written (module docstring)."""
    folders, root = RunFolders(Path(cfg.ckpt.output_dir)), checkpoint_dir(cfg)
    refuse_finished_run(cfg)
    try:
        if is_main:
            _lock(folders, folders.path, "--ckpt.output_dir")
        if root is None or not (cfg.ckpt.save_steps > 0 or cfg.ckpt.load_enable):
            if cfg.ckpt.load_enable:
                _refuse_finished(cfg, folders.path)
            return folders
        how = " (--ckpt.path unset: <--ckpt.output_dir>/checkpoints)" if cfg.ckpt.path is None else ""
        info(f"checkpoints: {root.resolve()}{how}")
        if is_main:
            _lock(folders, root, "--ckpt.path")
        max_mem = cfg.ckpt.max_mem if cfg.ckpt.max_mem is not None else math.inf
        folders.ckpt = CheckpointManager(root, max_num=cfg.ckpt.max_num, max_mem_gb=max_mem, is_main=is_main,
                                         identity=run_identity(cfg))
        folders.resume_from = folders.ckpt.prepare(cfg.ckpt.load_enable)
        if cfg.ckpt.load_enable and not any(root.glob("global_step*")):  # nothing it could resume
            _refuse_finished(cfg, folders.path)
        return folders
    except BaseException:
        folders.abandon()
        raise
