"""A start that fails before training (`RunFolders.abandon`) takes back only what the run wrote: in a folder
that existed before, another process's new entries stay, and the run files the start replaced
(config.yaml, metrics.jsonl) get their earlier bytes back; a folder the claim made is removed. The end of a
run: summary.json's eval metrics; the charts, unless POSTTRAIN_PLOTS=0."""
import json

import pytest

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


def test_the_summary_counts_rl_and_sft_evaluations_as_eval_metrics():
    from posttrain.trainers.run_summary import _final

    records = [{"step": 1, "train/loss": 2.0, "eval/loss": 1.5},
               {"step": 2, "reward/mean": 0.4, "eval_prompts_pass1": 0.25, "eval_prompts_pass4": 0.5}]
    assert _final(records, eval_part=True) == {"eval/loss": 1.5, "eval_prompts_pass1": 0.25,
                                               "eval_prompts_pass4": 0.5}
    assert _final(records, eval_part=False) == {"train/loss": 2.0, "reward/mean": 0.4}


@pytest.mark.parametrize("value", [None, "1", "0", "off"])
def test_a_run_draws_its_charts_unless_posttrain_plots_says_0(value, tmp_path, monkeypatch, capsys):
    from posttrain.trainers.run_loop import PLOTS_ENV, plot_charts

    monkeypatch.delenv(PLOTS_ENV, raising=False)  # tests/conftest.py sets 0 for the suite
    if value is not None:
        monkeypatch.setenv(PLOTS_ENV, value)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n"
                                                    for s in (1, 2)))
    drawn = plot_charts(tmp_path)
    err = capsys.readouterr().err
    if value in (None, "1"):
        assert drawn == [tmp_path / "plots" / "train.png"] and drawn[0].stat().st_size > 0
        assert f"plots: {drawn[0]}" in err
    else:
        assert drawn == [] and not (tmp_path / "plots").exists()
        assert f"no plots: POSTTRAIN_PLOTS={value} (posttrain plot {tmp_path} draws them)" in err
