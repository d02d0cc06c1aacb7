"""Fixtures for trainer tests: a synthetic arithmetic dataset folder (train.jsonl + test.jsonl),
a helper that runs the real SFT entry point in-process and returns its run directory, and a nano
model SFT-ed on single-digit addition (its samples are answers, some right) for RL/RM/DPO tests."""
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


@pytest.fixture(scope="session")
def sft_nano(tmp_path_factory, tiny_model_dir):
    """(sft_model_dir, data_dir): the nano model after one SFT epoch on 360 single-digit additions;
    data_dir holds train.jsonl (360 rows) and test.jsonl (40) with prompt/response/answer keys."""
    from posttrain.cli import train_sft
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    root = tmp_path_factory.mktemp("sft_nano")
    data = root / "data"
    rows = make_arithmetic_rows(400, seed=11, difficulty=0)
    write_jsonl(rows[:360], data / "train.jsonl")
    write_jsonl(rows[360:], data / "test.jsonl")
    sft = root / "sft"
    train_sft.main(["--model.model_name_or_path", tiny_model_dir, "--data.dataset", str(data),
                    "--data.input_key", "prompt", "--data.output_key", "response",
                    "--data.apply_chat_template", "--train.batch_size", "16",
                    "--train.micro_batch_size", "16", "--train.max_epochs", "1", "--adam.lr", "3e-3",
                    "--ckpt.output_dir", str(sft), "--data.max_len", "48"])
    return Path(sft), data


@pytest.fixture(scope="module")
def single_process(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """The single-process SFT run (`sft_flags` on the nano model and the arithmetic data) of a flag list,
    trained once per distinct list in a module: the reference that multi-rank runs are compared with."""
    from posttrain.cli import train_sft

    runs = {}

    def run(*flags):
        if flags not in runs:
            out = tmp_path_factory.mktemp("single") / "run"
            train_sft.main(sft_flags(tiny_model_dir, arithmetic_dir, out, *flags))
            runs[flags] = out
        return runs[flags]
    return run


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory):
    """A second llama "nano" causal LM (seed 1: other weights, the same tokenizer as `tiny_model_dir`): the
    teacher of `posttrain kd` runs that need any teacher."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("teacher") / "llama-nano-seed1"
    build_tiny(path, arch="llama", size="nano", head="lm", seed=1, verbose=False)
    return str(path)
