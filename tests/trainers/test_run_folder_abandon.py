"""A start that fails before training (`RunFolders.abandon`) takes back only what the run wrote: in a folder
that existed before, another process's new entries stay, and the run files the start replaced
(config.yaml, metrics.jsonl) get their earlier bytes back; a folder the claim made is removed."""
from posttrain.trainers.run_folders import RunFolders, _lock
from posttrain.utils.run_lock import LOCK_FILE


def test_an_existing_folder_keeps_other_entries_and_gets_its_run_files_back(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("old config\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "mine.txt").write_text("the user's")
    folders = RunFolders(run)
    _lock(folders, run, "--ckpt.output_dir")
    (run / "config.yaml").write_text("new config\n")  # the start's echo
    (run / "metrics.jsonl").unlink()  # a fresh logger
    (run / "plots").mkdir()
    (run / "other_run").mkdir()  # another process, meanwhile
    (run / "other_run" / "model.safetensors").write_bytes(b"weights")
    (run / "notes.txt").write_text("someone else's")
    folders.abandon()
    assert (run / "config.yaml").read_text() == "old config\n"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (run / "other_run" / "model.safetensors").read_bytes() == b"weights"
    assert (run / "notes.txt").exists() and (run / "mine.txt").exists()
    assert not (run / "plots").exists() and not (run / LOCK_FILE).exists()


def test_a_folder_the_claim_made_is_removed_whole(tmp_path):
    run = tmp_path / "a" / "run"
    folders = RunFolders(run)
    _lock(folders, run, "--ckpt.output_dir")
    (run / "config.yaml").write_text("new config\n")
    folders.abandon()
    assert not (tmp_path / "a").exists()
