"""A run's start and end as a new user meets them (issue 48): every missing input named at once before
anything is printed; an echo of only the flags the user set, with where each came from; a finished run's
folder kept unless --ckpt.overwrite; a failed start leaves nothing it created; the summary line and
summary.json; the warm-up note. The run whose summary.json records its command line is a real process (a
subprocess); the others run in this process through the console command's entry (`in_process`)."""
import hashlib
import json

import pytest

from tests.cli.test_cli_input_errors import in_process, one_error_line, ppo_argv, run


def sft(*flags):
    return run("-m", "posttrain.cli.main", "sft", *flags)


def rows(tmp_path, n=8):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "response": str(i + 1)}) + "\n"
                            for i in range(n)))
    return path


def sft_flags(model, data, out, *extra):
    return ["--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
            "--data.output_key", "response", "--train.batch_size", "4", "--train.micro_batch_size", "4",
            "--ckpt.output_dir", out, "--data.max_len", "48", *extra]


def hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()
            if p.is_file() and p.name != ".posttrain.lock"}


def echo(stderr: str) -> dict[str, str]:
    """{flag: source} of the start-up echo's flag lines."""
    lines = stderr.splitlines()
    start = next(i for i, ln in enumerate(lines) if "flag(s) set" in ln)
    out = {}
    for ln in lines[start + 1:]:
        if not ln.startswith("  --"):
            break
        flag, source = ln.strip().split(" ", 1)[0], ln.rsplit("(", 1)[1].rstrip(")")
        out[flag] = source
    return out


def test_two_missing_paths_are_both_named_before_anything_is_echoed(tmp_path, capfd):
    out = tmp_path / "new" / "run"
    proc = in_process(capfd, "sft", *sft_flags(tmp_path / "no-model", tmp_path / "no-rows.jsonl", out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    text = proc.stderr
    assert "missing or broken inputs (2 problems)" in text
    assert f"--model.model_name_or_path: model path '{tmp_path / 'no-model'}' not found" in text
    assert f"--data.dataset: dataset '{tmp_path / 'no-rows.jsonl'}': no such file or folder" in text
    assert "flag(s) set" not in text and "auto ->" not in text  # nothing echoed before the error
    assert not (tmp_path / "new").exists()


@pytest.mark.e2e
def test_the_echo_the_summary_and_a_finished_run_folder(tiny_model_dir, tmp_path, capfd):
    """One SFT run: the echo lists exactly the flags set, with their sources, and says where the whole
    config is; a warm-up over half the run is noted; the run ends with the summary line and summary.json.
    A re-run into its folder exits 2 and leaves the model byte-identical; with --ckpt.overwrite it runs."""
    config = tmp_path / "run.yaml"
    config.write_text("lr_warmup_ratio: 0.5\ntrain:\n  max_epochs: 1\n  batch_size: 8\n")
    out = tmp_path / "out"
    flags = sft_flags(tiny_model_dir, rows(tmp_path), out, "--config", config, "--eval.dataset",
                      rows(tmp_path), "--logger.logging_steps", "1")
    proc = sft(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = {f: "command line" for f in ("--model.model_name_or_path", "--data.dataset", "--data.input_key",
                                       "--data.output_key", "--train.batch_size", "--train.micro_batch_size",
                                       "--ckpt.output_dir", "--data.max_len", "--eval.dataset",
                                       "--logger.logging_steps")}
    yaml = {f: f"--config {config}" for f in ("--lr_warmup_ratio", "--train.max_epochs")}
    assert echo(proc.stderr) == {**cli, **yaml}
    assert f"every flag's value: {out / 'config.yaml'}" in proc.stderr
    assert "note: lr warm-up covers 1 of the 2 steps (50%, --lr_warmup_ratio 0.5)" in proc.stderr

    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer"] == "sft" and summary["steps"] == 2
    assert summary["command"].endswith(f"sft {' '.join(map(str, flags))}")
    assert set(summary["versions"]) >= {"posttrain", "torch", "transformers"}
    assert summary["posttrain_git"] is None or len(summary["posttrain_git"].split("-")[0]) == 40
    assert {"train/loss", "train/acc"} <= set(summary["final_train_metrics"])
    assert set(summary["final_eval_metrics"]) == {"eval/loss", "eval/acc"}
    assert summary["model"] == str(out.resolve())
    assert summary["timings"]["wall_s"] >= summary["timings"]["train_s"] >= 0
    line = [ln for ln in proc.stderr.splitlines() if "sft finished:" in ln]
    loss = summary["final_train_metrics"]["train/loss"]
    assert line, proc.stderr[-3000:]
    assert "sft finished: 2 steps in " in line[0] and f"train loss {loss:.4g}" in line[0], line[0]
    assert f"eval loss {summary['final_eval_metrics']['eval/loss']:.4g}" in line[0]
    assert line[0].endswith(f"model in {out} (summary.json there)")

    before = hashes(out)
    again = in_process(capfd, "sft", *flags)
    one_error_line(again, f"--ckpt.output_dir {out} holds a finished run (summary.json)", "--ckpt.overwrite")
    assert hashes(out) == before
    replaced = in_process(capfd, "sft", *flags, "--ckpt.overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "sft finished: 2 steps" in replaced.stderr


def test_a_folder_with_a_saved_model_but_no_summary_is_a_finished_run_too(tiny_model_dir, tmp_path, capfd):
    """A model folder from before summary.json (or from OpenRLHF) is not overwritten either."""
    import shutil

    out = shutil.copytree(tiny_model_dir, tmp_path / "model-folder")
    before = hashes(out)
    proc = in_process(capfd, "sft", *sft_flags(tiny_model_dir, rows(tmp_path), out))
    one_error_line(proc, "holds a finished run (a saved model)")
    assert hashes(out) == before


def test_a_failed_start_leaves_nothing_it_created(tiny_model_dir, tmp_path, capfd):
    """A row without a key the first row has fails after the run folder is claimed (the keys of the first
    row are checked before): a folder the run made is gone, and in a folder that was there only what was
    there before stays."""
    data = rows(tmp_path)
    lines = data.read_text().splitlines()
    lines[4] = lines[4].replace('"response"', '"answer"')
    data.write_text("\n".join(lines) + "\n")
    made = tmp_path / "runs" / "sft"
    proc = in_process(capfd, "sft", *sft_flags(tiny_model_dir, data, made))
    one_error_line(proc, "rows.jsonl, row 5: missing key 'response'")
    assert not (tmp_path / "runs").exists()

    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    proc = in_process(capfd, "sft", *sft_flags(tiny_model_dir, data, kept))
    one_error_line(proc, "rows.jsonl, row 5: missing key 'response'")
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]


@pytest.mark.slow  # a run of a few seconds
def test_ppo_ends_with_the_summary_line_and_summary_json(tiny_model_dir, tmp_path, capfd):
    reward = tmp_path / "zero.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    proc = in_process(capfd, *ppo_argv(tiny_model_dir, tmp_path, "--reward.remote_url", reward,
                                       "--train.max_steps", "1", "--algo.advantage.estimator", "group_norm"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer"] == "ppo" and summary["steps"] == 1 and summary["model"] == str(out.resolve())
    assert summary["final_train_metrics"]["reward/mean"] == 0.0
    assert summary["final_eval_metrics"] == {}
    assert set(summary["timings"]) == {"started", "ended", "setup_s", "train_s", "wall_s"}
    line = [ln for ln in proc.stderr.splitlines() if "ppo finished:" in ln]
    assert line and "ppo finished: 1 steps in " in line[0] and "reward/mean 0" in line[0], proc.stderr[-3000:]
