import pytest

from posttrain.utils.checkpoint import CheckpointManager, read_manifest, verify_checkpoint


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
