"""End to end: `posttrain sft --ds.lora.rank 4` saves an adapter, `python -m
posttrain.cli.lora_combiner` merges it into a plain HF model with the adapter model's logits;
`posttrain lora-merge` errors and `--ds.load_in_4bit` on CPU exit 2 with a clear message."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli.main import main as posttrain
from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

pytestmark = pytest.mark.e2e

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
IDS = torch.tensor([[5, 17, 230, 41, 9, 88, 3, 140]])


def run(*args):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV,
                          timeout=300, check=False)


def sft_flags(model, data, out):
    return [str(f) for f in [
            "--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
            "--data.output_key", "response", "--data.apply_chat_template", "--data.max_len", "48",
            "--train.batch_size", "2", "--train.micro_batch_size", "2", "--train.max_epochs", "1",
            "--ckpt.output_dir", out, "--ds.param_dtype", "fp32", "--logger.logging_steps", "1"]]


def test_sft_lora_then_merge_gives_the_adapter_model(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = tmp_path / "data.jsonl"
    write_jsonl(make_arithmetic_rows(4, seed=3), data)
    run_dir = tmp_path / "sft"
    posttrain(["sft", *sft_flags(tiny_model_dir, data, run_dir), "--ds.lora.rank", "4",
               "--ds.lora.alpha", "8",
               "--ds.lora.target_modules", "q_proj", "v_proj", "--adam.lr", "0.05"])
    assert (run_dir / "adapter_config.json").is_file() and not (run_dir / "model.safetensors").exists()
    trained_b = [t for k, t in load_file(run_dir / "adapter_model.safetensors").items() if "lora_B" in k]
    assert len(trained_b) == 8 and all(t.abs().max() > 0 for t in trained_b)  # 2 steps moved B off 0

    proc = run("-m", "posttrain.cli.lora_combiner", "--model_path", tiny_model_dir, "--lora_path", run_dir,
               "--output_path", tmp_path / "merged", "--ds.param_dtype", "fp32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapter_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run_dir)
    with torch.no_grad():
        want = adapter_model(input_ids=IDS).logits
        got = merged(input_ids=IDS).logits
        base = adapter_model.get_base_model()
        with adapter_model.disable_adapter():
            before = base(input_ids=IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (before - want).abs().max() > 1e-3


def test_console_lora_merge_error_exits_2(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        posttrain(["lora-merge", "--lora_path", tiny_model_dir, "--output_path", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "posttrain lora-merge: error: lora_path" in err and "not a LoRA adapter folder" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["sft", "rm", "dpo"])
def test_load_in_4bit_on_cpu_is_a_clear_config_error(command, tiny_model_dir, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU message is only given on a machine without CUDA")
    flags = sft_flags(tiny_model_dir, tmp_path / "d.jsonl", tmp_path / "o")
    if command != "sft":
        flags = flags[:2] + ["--data.dataset", str(tmp_path / "d.jsonl"),
                             "--ckpt.output_dir", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exc:
        posttrain([command, *flags, "--ds.lora.rank", "4", "--ds.load_in_4bit"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--ds.load_in_4bit: bitsandbytes 4-bit loading needs a CUDA GPU; this run is on CPU" in err
    assert not (tmp_path / "o").exists()
