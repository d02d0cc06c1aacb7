"""Fixtures for trainer tests: a synthetic arithmetic dataset folder (train.jsonl + test.jsonl)
and a helper that runs the real SFT entry point in-process and returns its run directory."""
from pathlib import Path

import pytest
from sft_helpers import sft_flags


@pytest.fixture(scope="session")
def arithmetic_dir(tmp_path_factory):
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    path = tmp_path_factory.mktemp("arith")
    rows = make_arithmetic_rows(96, seed=3, difficulty=0)
    write_jsonl(rows[:64], path / "train.jsonl")
    write_jsonl(rows[64:], path / "test.jsonl")
    return path


@pytest.fixture
def run_sft(tiny_model_dir, arithmetic_dir, tmp_path):
    def run(*extra, name="run", data_dir=None) -> Path:
        from posttrain.cli import train_sft

        out = tmp_path / name
        train_sft.main(sft_flags(tiny_model_dir, data_dir or arithmetic_dir, out, *extra))
        return out
    return run
