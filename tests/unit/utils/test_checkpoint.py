import math

import pytest

from posttrain.utils.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    read_manifest,
    verify_checkpoint,
)


def _writer(payload: bytes):
    def write(d):
        (d / "weights.bin").write_bytes(payload)
        (d / "sub").mkdir()
        (d / "sub" / "opt.bin").write_bytes(payload[::-1])
    return write


def test_save_writes_manifest_and_verifies(tmp_path):
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(3, _writer(b"abc" * 100), {"epoch": 1})
    assert path.name == "global_step3"
    assert verify_checkpoint(path) is None
    m = read_manifest(path)
    assert m["step"] == 3 and m["meta"] == {"epoch": 1}
    assert set(m["files"]) == {"weights.bin", "sub/opt.bin"}


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=1)
    mgr.save(1, _writer(b"one"), {})

    def crashing(d):
        (d / "weights.bin").write_bytes(b"partial")
        raise KeyboardInterrupt("killed mid-save")

    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, crashing, {})
    assert [s for s, _ in mgr.valid_checkpoints()] == [1]
    assert mgr.latest().name == "global_step1"
    # the next successful save replaces the leftover temp dir and rotates step 1 away
    mgr.save(2, _writer(b"two"), {})
    assert [s for s, _ in mgr.step_dirs()] == [2]
    assert not (tmp_path / ".tmp_step2").exists()


def test_rotation_by_count_and_size(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=2)
    for step in (1, 2, 3):
        mgr.save(step, _writer(b"x" * 10), {})
    assert [s for s, _ in mgr.step_dirs()] == [3, 2]
    tiny = CheckpointManager(tmp_path / "mem", max_num=5, max_mem_gb=30 / 1024**3)  # 30 bytes
    for step in (1, 2, 3):
        tiny.save(step, _writer(b"x" * 10), {})  # each checkpoint holds 20 bytes of files
    assert [s for s, _ in tiny.step_dirs()] == [3]  # never deletes the newest


def _metric(value, higher_is_better=True):
    return {"metric": None if value is None else {"key": "eval/m", "value": value, "step": 0,
                                                  "higher_is_better": higher_is_better}}


def test_rotation_deletes_unevaluated_then_worst_then_oldest(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=3)
    kept = []
    for step, value in [(1, None), (2, 0.9), (3, 0.2), (4, 0.5), (5, 0.4), (6, 0.5), (7, 0.9)]:
        mgr.save(step, _writer(b"x"), _metric(value))
        kept.append(sorted(s for s, _ in mgr.step_dirs()))
    # 4: step 1 has no metric; 5: 3 is the worst; 6: 5 the worst; 7: 4 and 6 tie at 0.5, the older goes
    assert kept[3:] == [[2, 3, 4], [2, 4, 5], [2, 4, 6], [2, 6, 7]]
    (tmp_path / "global_step2" / MANIFEST).write_text("{not json")  # unreadable: counts as no metric
    mgr.save(8, _writer(b"x"), _metric(0.1))
    assert sorted(s for s, _ in mgr.step_dirs()) == [6, 7, 8]


def test_rotation_of_a_loss_keeps_the_lowest_and_max_mem_follows_the_same_order(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=2)
    for step, loss in [(1, 1.0), (2, 0.5), (3, 2.0)]:
        mgr.save(step, _writer(b"x"), _metric(loss, higher_is_better=False))
    assert [s for s, _ in mgr.step_dirs()] == [3, 2]  # 1.0 is a worse loss than 0.5
    mem = CheckpointManager(tmp_path / "mem", max_num=5)
    for step, value in [(1, 0.9), (2, 0.1), (3, None)]:
        path = mem.save(step, _writer(b"x" * 10), _metric(value))
        mem.max_mem_bytes = 2.5 * sum(f.stat().st_size for f in path.rglob("*") if f.is_file())  # room for 2
    assert [s for s, _ in mem.step_dirs()] == [3, 1]


def test_best_checkpoints_outlive_rotation_and_resume(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=1, identity=_identity(run_id="r"))
    mgr.save(2, _writer(b"a"), {})
    mgr.save(2, _writer(b"a"), {}, best=True)
    mgr.save(4, _writer(b"b"), {})
    mgr.save(6, _writer(b"c"), {}, best=True)  # replaces the earlier best
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["best_global_step6", "global_step4"]
    with pytest.raises(CheckpointError, match="steps 4, 6"):  # a best one is a checkpoint of the run too
        CheckpointManager(tmp_path, identity=_identity()).prepare(resume=False)
    assert CheckpointManager(tmp_path, identity=_identity()).prepare(resume=True).name == "best_global_step6"
    mgr.save(6, _writer(b"c"), {})
    assert [p.name for _, p in mgr.valid_checkpoints()][:2] == ["global_step6", "best_global_step6"]


def test_hf_exports_are_atomic_and_never_rotated(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=1)
    for step in (1, 2, 3):
        mgr.save(step, _writer(b"x"), {})
        mgr.save_export(f"global_step{step}_hf", lambda d: (d / "model.bin").write_bytes(b"w"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step1_hf", "global_step2_hf", "global_step3", "global_step3_hf"]

    def crashing(d):
        (d / "model.bin").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mgr.save_export("global_step3_hf", crashing)
    assert (tmp_path / "global_step3_hf" / "model.bin").read_bytes() == b"w" and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "delete"])
def test_corrupt_checkpoint_is_detected_and_skipped(tmp_path, damage, capsys):
    mgr = CheckpointManager(tmp_path, max_num=5)
    mgr.save(1, _writer(b"good" * 50), {})
    p2 = mgr.save(2, _writer(b"newer" * 50), {})
    w = p2 / "weights.bin"
    if damage == "truncate":
        w.write_bytes(w.read_bytes()[:10])
    elif damage == "flip":
        data = bytearray(w.read_bytes())
        data[5] ^= 0xFF
        w.write_bytes(bytes(data))
    elif damage == "manifest":
        (p2 / "manifest.json").write_text("{not json")
    else:
        w.unlink()
    problem = verify_checkpoint(p2)
    assert problem is not None and ("weights.bin" in problem or "manifest" in problem)
    assert mgr.latest().name == "global_step1"
    assert "skipping checkpoint" in capsys.readouterr().err


# ---- checkpoints belong to a run ---------------------------------------------------------------
def _identity(seed=1, epochs=1, run_id=None):
    from posttrain.utils.checkpoint import RunIdentity

    fields = {"trainer": "sft", "train.seed": seed, "adam.betas": [0.9, 0.95]}
    ident = RunIdentity(fingerprint=f"fp-seed{seed}", fields=fields, adjustable={"train.max_epochs": epochs})
    if run_id:
        ident.run_id = run_id
    return ident


def _steps(root):
    return sorted(int(p.name.removeprefix("global_step")) for p in root.glob("global_step*"))


def test_rotation_only_touches_this_runs_checkpoints(tmp_path):
    other = CheckpointManager(tmp_path, max_num=5, identity=_identity(run_id="other"))
    for step in (12, 14, 16):
        other.save(step, _writer(b"old run"), {})
    mine = CheckpointManager(tmp_path, max_num=2, identity=_identity(run_id="mine"))
    for step in (1, 2, 3, 4):
        path = mine.save(step, _writer(b"new run"), {})
        assert path.is_dir()  # the checkpoint just written is never rotated away
    assert _steps(tmp_path) == [3, 4, 12, 14, 16]
    assert read_manifest(tmp_path / "global_step4")["run"]["run_id"] == "mine"


def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path):
    mgr = CheckpointManager(tmp_path, max_num=1, identity=_identity(run_id="r"))
    mgr.save(10, _writer(b"a"), {})
    mgr.save(5, _writer(b"b"), {})  # e.g. resumed from an older step: the new one wins over a higher step
    assert _steps(tmp_path) == [5]
    tiny = CheckpointManager(tmp_path / "mem", max_num=5, max_mem_gb=1e-12, identity=_identity(run_id="r"))
    tiny.save(1, _writer(b"x" * 10), {})
    tiny.save(2, _writer(b"x" * 10), {})
    assert _steps(tmp_path / "mem") == [2]


def test_fresh_run_into_a_folder_with_checkpoints_is_refused(tmp_path):
    other = CheckpointManager(tmp_path, identity=_identity(run_id="other"))
    for step in (12, 14, 16):
        other.save(step, _writer(b"old"), {})
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # same flags too: a fresh run never writes over another run's checkpoints
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(tmp_path, identity=_identity()).prepare(resume=False)
    msg = str(e.value)
    assert str(tmp_path) in msg and "steps 12, 14, 16" in msg and "--ckpt.load_enable" in msg
    assert "another (or empty) --ckpt.path" in msg and "\n" not in msg
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert CheckpointManager(tmp_path / "empty").prepare(resume=False) is None


def test_resume_refuses_other_flags_and_never_falls_back(tmp_path):
    CheckpointManager(tmp_path, max_num=5, identity=_identity(seed=2, run_id="a")).save(3, _writer(b"a"), {})
    CheckpointManager(tmp_path, max_num=5, identity=_identity(seed=1, run_id="b")).save(6, _writer(b"b"), {})
    with pytest.raises(CheckpointError) as e:  # step 3 has this run's flags, but 6 is the newest
        CheckpointManager(tmp_path, identity=_identity(seed=2)).prepare(resume=True)
    msg = str(e.value)
    assert "global_step6" in msg and "--train.seed: checkpoint 1, this run 2" in msg
    assert "another --ckpt.path" in msg and "adam.betas" not in msg


def test_resume_takes_the_run_id_and_names_changed_run_length(tmp_path, capsys):
    first = CheckpointManager(tmp_path, max_num=2, identity=_identity(run_id="lineage"))
    first.save(2, _writer(b"a"), {})
    first.save(4, _writer(b"b"), {})
    resumed = CheckpointManager(tmp_path, max_num=2, identity=_identity(epochs=3))
    assert resumed.prepare(resume=True).name == "global_step4"
    assert resumed.identity.run_id == "lineage" and resumed.last_good.name == "global_step4"
    assert "--train.max_epochs: checkpoint 1, this run 3" in capsys.readouterr().err
    resumed.save(6, _writer(b"c"), {})
    assert _steps(tmp_path) == [4, 6]  # rotation treats the resumed lineage as its own


def test_disk_full_keeps_earlier_checkpoints_and_names_the_last_good_one(tmp_path):
    import errno

    mgr = CheckpointManager(tmp_path, identity=_identity())
    good = mgr.save(2, _writer(b"good"), {})

    def full(d):
        (d / "weights.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError) as e:
        mgr.save(4, full, {})
    assert str(e.value) == (f"no space left on device while writing checkpoint step 4 to {tmp_path}; the "
                            f"last good checkpoint is {good} (free space or lower --ckpt.max_num)")
    assert not list(tmp_path.glob(".tmp_step*")) and verify_checkpoint(good) is None
    assert _steps(tmp_path) == [2]


def test_disk_full_reason_recognises_torch_save_and_quota_errors(tmp_path, monkeypatch):
    import errno
    import shutil
    from collections import namedtuple

    from posttrain.utils.checkpoint import disk_full_reason

    assert disk_full_reason(OSError(errno.EDQUOT, "quota")) == "disk quota exceeded"
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as wrapped:
        assert disk_full_reason(wrapped) == "no space left on device"
    assert disk_full_reason(OSError(errno.EACCES, "denied")) is None
    # torch 2.13 loses the errno: what decides is the free space of the target, never the message
    torch_full = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 448; "
                              "basic_ios::clear: iostream error")
    assert disk_full_reason(torch_full, tmp_path) is None  # plenty of space: another fault
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 0))
    assert disk_full_reason(torch_full, tmp_path / "not" / "yet") == "no space left on device"
    assert disk_full_reason(KeyboardInterrupt(), tmp_path) is None


def test_a_file_the_manifest_does_not_list_fails_verification(tmp_path):
    mgr = CheckpointManager(tmp_path, identity=_identity())
    path = mgr.save(1, _writer(b"one"), {})
    assert verify_checkpoint(path) is None
    (path / "engine").mkdir()
    (path / "engine" / "extra.pt").write_bytes(b"x")
    assert verify_checkpoint(path) == f"{path / 'engine' / 'extra.pt'} is not listed in {path / MANIFEST} " \
                                      "(added after the save)"


def test_resume_refuses_a_checkpoint_that_records_no_run(tmp_path):
    """DeepSpeed unpickles its engine files: resume only what a posttrain run wrote (its manifest's run id),
    and say so before anything is loaded."""
    path = CheckpointManager(tmp_path).save(2, _writer(b"two"), {})  # a writer without a run identity
    assert verify_checkpoint(path) is None and read_manifest(path)["run"] is None
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(tmp_path, identity=_identity()).prepare(resume=True)
    assert str(e.value).startswith(f"cannot resume from checkpoint {path}: its manifest records no posttrain "
                                   f"run id")
    assert "\n" not in str(e.value)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # unpickling creates the marker file


def test_state_files_hold_plain_values_and_a_crafted_one_never_runs(tmp_path):
    import torch

    from posttrain.utils.checkpoint import load_state_file, save_state_file
    from posttrain.utils.seeding import rng_state

    state = {"rng": rng_state(), "kl_ctl": {"value": 0.1}, "best": {"key": None, "value": -math.inf}}
    save_state_file(state, tmp_path / "ok.pt")
    back = load_state_file(tmp_path / "ok.pt")
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"]) and back["best"] == state["best"]
    marker = tmp_path / "ran"
    torch.save({"rng": _RunsCode(marker)}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        load_state_file(tmp_path / "bad.pt")
    assert not marker.exists()
    assert (str(e.value).startswith(f"checkpoint file {tmp_path / 'bad.pt'} holds objects other than tensors "
                                    f"and plain values") and "\n" not in str(e.value))


def test_interrupted_save_leaves_no_temp_folder_and_stale_ones_are_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, identity=_identity())
    mgr.save(1, _writer(b"one"), {})

    def interrupted(d):
        (d / "weights.bin").write_bytes(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, interrupted, {})
    assert not list(tmp_path.glob(".tmp_step*"))
    (tmp_path / ".tmp_step7").mkdir()  # left by a kill -9
    assert CheckpointManager(tmp_path, identity=_identity()).prepare(resume=True).name == "global_step1"
    assert not (tmp_path / ".tmp_step7").exists()


def test_checkpoint_mid_replacement_still_counts(tmp_path):
    mgr = CheckpointManager(tmp_path, identity=_identity())
    mgr.save(3, _writer(b"three"), {})
    (tmp_path / "global_step3").rename(tmp_path / ".old_step3")  # crash between the two renames
    assert [s for s, _ in mgr.valid_checkpoints()] == [3]
    mgr.save(3, _writer(b"again"), {})
    assert [p.name for _, p in mgr.step_dirs()] == ["global_step3"] and not (tmp_path / ".old_step3").exists()


def test_rotation_deletes_a_non_finite_metric_first(tmp_path):
    """A NaN metric cannot be ranked: it counts as no metric, so the good checkpoints stay."""
    mgr = CheckpointManager(tmp_path, max_num=2)
    for step, value in [(1, math.nan), (2, 0.5), (3, 0.1), (4, 0.9)]:
        mgr.save(step, _writer(b"x"), _metric(value))
    assert sorted(s for s, _ in mgr.step_dirs()) == [2, 4]
    mgr.save(5, _writer(b"x"), _metric(math.inf))
    assert sorted(s for s, _ in mgr.step_dirs()) == [4, 5]  # the newest is never deleted; 0.5 < 0.9 goes
