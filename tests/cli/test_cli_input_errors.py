"""Bad input caught with one line and exit status 2 (issue 29, round 2): SFT's dropped rows, broken
model folders, YAML duplicates, values starting with '-'. The real entry points run as subprocesses."""
import json
import os
import subprocess
import sys

import pytest

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)


def sft(*flags):
    return run("-m", "posttrain.cli.train_sft", *flags)


def one_error_line(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert line, proc.stderr[-3000:]
    for needle in needles:
        assert needle in line[-1], line[-1]
    return line[-1]


def flags(model, data, out, *extra):
    return ["--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
            "--data.output_key", "response", "--train.batch_size", "4", "--train.micro_batch_size", "2",
            "--train.max_epochs", "1", "--ckpt.output_dir", out, "--data.max_len", "48", "--ckpt.save_steps", "-1",
            "--eval.steps", "-1", "--logger.logging_steps", "1", *extra]


def half_long_rows(path):
    """16 rows; the odd ones have a prompt far longer than 48 tokens."""
    rows = [{"prompt": ("word " * 200 if i % 2 else f"What is {i} + 1?"), "response": str(i + 1)} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_stops_when_more_than_max_dropped_frac_of_rows_do_not_fit(tiny_model_dir, tmp_path):
    data = half_long_rows(tmp_path / "rows.jsonl")
    proc = sft(*flags(tiny_model_dir, data, tmp_path / "o"))
    one_error_line(proc, "8 of 16 rows (50%)", "rows.jsonl, row 2", "--data.max_dropped_frac 0.1")
    assert not (tmp_path / "o" / "model.safetensors").exists()


def test_sft_reports_the_rows_it_drops(tiny_model_dir, tmp_path):
    data = half_long_rows(tmp_path / "rows.jsonl")
    proc = sft(*flags(tiny_model_dir, data, tmp_path / "o", "--data.max_dropped_frac", "0.5"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 of 16 rows (50%) dropped because the prompt alone fills --data.max_len 48" in proc.stderr
    assert "(first: " in proc.stderr and "rows.jsonl, row 2)" in proc.stderr
    assert len(read_metrics(tmp_path / "o" / "metrics.jsonl")) == 2
