"""The real entry points: console command, module names, clear errors (exit 2). Subprocesses where the process
matters (the console command, runs that train); the user errors through the same entry called in this
process (`in_process`; tests/cli/test_fast_errors.py runs a mistake of every command as a subprocess)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.utils.metrics import read_metrics
from tests.cli.test_cli_input_errors import in_process

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def run(*args, check=True, timeout=300):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-3000:]}")
    return proc


def sft(*flags, check=False):
    return run("-m", "posttrain.cli.train_sft", *flags, check=check)


def base_flags(model, data, out):
    return ["--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
            "--data.output_key", "response", "--data.apply_chat_template", "--train.batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_epochs", "1", "--ckpt.output_dir", out]


@pytest.mark.e2e
def test_console_command_lists_subcommands_and_rejects_unknown():
    out = run("-m", "posttrain.cli.main", "--help").stdout
    for name in ("init-tiny", "sft", "plot", "demo"):
        assert name in out
    bad = run("-m", "posttrain.cli.main", "sfft", check=False)
    assert bad.returncode == 2 and "did you mean 'sft'" in bad.stderr


def test_init_tiny_into_a_non_empty_folder_or_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    proc = in_process(capsys, "init-tiny", "--output", tmp_path / "full", "--size", "nano")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"posttrain init-tiny: error: --output {tmp_path / 'full'} is not empty; choose a new or empty "
        f"folder, or pass --overwrite to replace its contents")
    assert (tmp_path / "full" / "keep.txt").exists()
    proc = in_process(capsys, "init-tiny", "--output", tmp_path / "full" / "keep.txt")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"posttrain init-tiny: error: --output {tmp_path / 'full' / 'keep.txt'} is a file, not a folder; "
        f"choose a new or empty folder")


def test_init_tiny_refuses_an_unknown_shape_in_one_line(tmp_path, capsys):
    proc = in_process(capsys, "init-tiny", "--output", tmp_path / "m", "--shape", "gpt5")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "posttrain init-tiny: error: --shape gpt5: unknown shape; known shapes: qwen2.5-0.5b, qwen2.5-1.5b, "
        "llama3.2-1b"]
    assert not (tmp_path / "m").exists()


@pytest.mark.e2e
def test_init_tiny_vision_builds_a_vlm_and_refuses_other_flags_in_one_line(tmp_path):
    from posttrain.models.vision import is_vision_folder, load_processor

    summary = json.loads(run("-m", "posttrain.cli.main", "init-tiny", "--output", tmp_path / "v", "--vision",
                             "--size", "nano").stdout)
    assert summary["arch"] == "qwen2_5_vl" and summary["vision"] and is_vision_folder(tmp_path / "v")
    assert load_processor(tmp_path / "v").image_processor is not None
    proc = run("-m", "posttrain.cli.main", "init-tiny", "--output", tmp_path / "w", "--vision",
               "--head", "score", "--arch", "qwen2", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "posttrain init-tiny: error: --vision builds a tiny Qwen2.5-VL from a --size preset in fp32; drop "
        "--arch, --head score"]


@pytest.mark.e2e
def test_init_tiny_cli_builds_loadable_models(tmp_path):
    summary = json.loads(run("-m", "posttrain.cli.main", "init-tiny", "--output", tmp_path / "m",
                             "--arch", "qwen2", "--size", "nano").stdout)
    assert summary["arch"] == "qwen2" and summary["num_parameters"] > 500_000
    run("-m", "posttrain.cli.main", "init-tiny", "--output", tmp_path / "rm", "--size", "nano",
        "--head", "score")
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    assert AutoTokenizer.from_pretrained(tmp_path / "m").eos_token == "<|im_end|>"
    AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert AutoConfig.from_pretrained(tmp_path / "rm").num_labels == 1


@pytest.mark.e2e
def test_openrlhf_train_sft_script_runs_with_only_the_module_renamed(tiny_model_dir, tmp_path):
    """examples/scripts/train_sft.sh of OpenRLHF 0.10.2 (dotted flags); model and data point at local
    tiny ones, sizes shrunk, GPU-only flags (flash attention, bf16 on GPU, wandb) left out."""
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    data = tmp_path / "data.jsonl"
    write_jsonl([{"question": r["prompt"], "response": r["response"]}
                 for r in make_arithmetic_rows(24, seed=1)], data)
    out = tmp_path / "sft"
    proc = sft(
        "--data.max_len", "64", "--data.dataset", data, "--data.input_key", "question",
        "--data.output_key", "response", "--data.input_template", "User: {}\nAssistant: ",
        "--train.batch_size", "8", "--train.micro_batch_size", "2", "--data.max_samples", "500000",
        "--model.model_name_or_path", tiny_model_dir, "--ckpt.output_dir", out, "--ckpt.save_steps", "-1",
        "--logger.logging_steps", "1", "--eval.steps", "-1", "--ds.zero_stage", "2",
        "--train.max_epochs", "1", "--ds.packing_samples", "--ds.param_dtype", "fp32", "--adam.lr", "5e-6",
        "--model.gradient_checkpointing_enable", check=True)
    assert len(read_metrics(out / "metrics.jsonl")) == 3
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
    assert "world_size = 1" in proc.stderr and "gradient_accumulation_steps = 4" in proc.stderr


def test_malformed_jsonl_row_names_file_and_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "response": "2"}\n{"prompt": "What is 2 + 2?", "respo\n')
    proc = in_process(capsys, "sft", *base_flags(tiny_model_dir, data, tmp_path / "o"))
    assert proc.returncode == 2
    assert "bad.jsonl" in proc.stderr and "line 2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_key_names_row_key_and_flag(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "response": "2"}\n{"question": "What is 2 + 2?", '
                    '"response": "4"}\n')
    proc = in_process(capsys, "sft", *base_flags(tiny_model_dir, data, tmp_path / "o"))
    assert proc.returncode == 2
    assert "rows.jsonl" in proc.stderr and "2" in proc.stderr and "'prompt'" in proc.stderr
    assert "--data.input_key" in proc.stderr


def test_unknown_flag_suggests_closest(tiny_model_dir, tmp_path, capsys):
    proc = in_process(capsys, "sft", *base_flags(tiny_model_dir, tmp_path / "x.jsonl", tmp_path / "o"),
                      "--train.micro_batchsize", "2")
    assert proc.returncode == 2 and "--train.micro_batch_size" in proc.stderr


def test_old_openrlhf_flag_names_its_replacement(tiny_model_dir, tmp_path, capsys):
    proc = in_process(capsys, "sft", "--pretrain", tiny_model_dir)
    assert proc.returncode == 2 and "--model.model_name_or_path" in proc.stderr


def test_invalid_combination_fails_before_loading_anything(tiny_model_dir, tmp_path, capsys):
    proc = in_process(capsys, "sft", *base_flags(tiny_model_dir, tmp_path / "missing.jsonl", tmp_path / "o"),
                      "--data.multiturn", "--train.batch_size", "6", "--train.micro_batch_size", "4")
    assert proc.returncode == 2
    assert "--data.multiturn" not in proc.stderr or "apply_chat_template" in proc.stderr
    assert "--train.batch_size" in proc.stderr  # 6 is not a multiple of micro 4 x 1 rank
    assert not (tmp_path / "o").exists()  # nothing was written: validation ran first


@pytest.mark.e2e
def test_plot_cli(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "train/loss": 1 / i}) + "\n"
                                                    for i in range(1, 4)))
    out = run("-m", "posttrain.cli.main", "plot", tmp_path).stdout
    assert Path(out.strip()).name == "train.png"
    overlaid = run("-m", "posttrain.cli.main", "plot", tmp_path, tmp_path / "metrics.jsonl",
                   "--out", tmp_path / "c")
    assert overlaid.stdout.strip() == str(tmp_path / "c" / "train.png")
    missing = run("-m", "posttrain.cli.main", "plot", tmp_path / "nope", check=False)
    assert missing.returncode == 2 and "metrics.jsonl" in missing.stderr
