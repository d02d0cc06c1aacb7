"""Fixtures for trainer tests: a synthetic arithmetic dataset folder (train.jsonl + test.jsonl)
and a helper that runs the real SFT entry point in-process and returns its run directory."""
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def arithmetic_dir(tmp_path_factory):
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    path = tmp_path_factory.mktemp("arith")
    rows = make_arithmetic_rows(96, seed=3, difficulty=0)
    write_jsonl(rows[:64], path / "train.jsonl")
    write_jsonl(rows[64:], path / "test.jsonl")
    return path


def sft_flags(model_dir, data_dir, out_dir, *extra) -> list[str]:
    return ["--model.model_name_or_path", str(model_dir), "--data.dataset", str(data_dir),
            "--data.input_key", "prompt", "--data.output_key", "response", "--data.apply_chat_template",
            "--data.max_len", "48", "--train.batch_size", "8", "--train.micro_batch_size", "8",
            "--train.max_epochs", "1", "--adam.lr", "1e-3", "--ckpt.output_dir", str(out_dir),
            "--eval.dataset", str(data_dir), "--eval.split", "test", "--logger.logging_steps", "1", *map(str, extra)]


@pytest.fixture
def run_sft(tiny_model_dir, arithmetic_dir, tmp_path):
    def run(*extra, name="run", data_dir=None) -> Path:
        from posttrain.cli import train_sft

        out = tmp_path / name
        train_sft.main(sft_flags(tiny_model_dir, data_dir or arithmetic_dir, out, *extra))
        return out
    return run
