"""One writer per run directory: flock on <dir>/.posttrain.lock, stale locks of dead processes free."""
import os
import signal
import subprocess
import sys

import pytest

from posttrain.utils.run_lock import LOCK_FILE, RunDirInUse, RunLock, lock_owner

HOLD = ("import sys, time; from posttrain.utils.run_lock import RunLock; "
        "lock = RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)")


def test_second_writer_is_refused_until_the_first_dies_even_by_kill_9(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirInUse) as e:
            RunLock(run_dir).acquire()
        msg = str(e.value)
        assert msg.startswith(f"--ckpt.output_dir {run_dir} is in use by another posttrain run "
                              f"(pid {holder.pid}, started ")
        assert msg.endswith("; wait for it or choose another --ckpt.output_dir")
        with pytest.raises(RunDirInUse, match="wait for it or choose another --ckpt.path$"):
            RunLock(run_dir, "--ckpt.path").acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert (run_dir / LOCK_FILE).exists()  # the stale file stays, and does not block
    with RunLock(run_dir) as lock:
        assert lock.held and lock_owner(run_dir)["pid"] == os.getpid()
    assert not lock.held


def test_a_lock_left_behind_in_this_process_is_taken_over(tmp_path):
    left_behind = RunLock(tmp_path).acquire()  # e.g. a run object kept alive by a traceback
    with RunLock(tmp_path) as lock:
        assert lock.held and not left_behind.held
    code = "import sys; from posttrain.utils.run_lock import RunLock; RunLock(sys.argv[1]).acquire()"
    # released
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False).returncode == 0


def test_a_folder_that_cannot_be_written_is_one_clear_error(tmp_path, monkeypatch):
    import errno

    from posttrain.utils.run_lock import RunDirUnusable

    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirUnusable, match=r"--ckpt.output_dir .*/file is a file, not a folder; choose a "
                                             r"folder"):
        RunLock(tmp_path / "file").acquire()
    real_open = os.open

    def read_only(path, *a, **k):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(RunDirUnusable) as e:
        RunLock(tmp_path / "ro", "--ckpt.path").acquire()
    assert str(e.value) == (f"--ckpt.path {tmp_path / 'ro'} cannot be written (it is on a read-only file "
                            f"system); choose a writable folder for --ckpt.path")
