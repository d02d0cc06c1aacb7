"""Helpers shared by the SFT trainer tests."""
import torch
from safetensors.torch import load_file


def sft_flags(model_dir, data_dir, out_dir, *extra) -> list[str]:
    return ["--model.model_name_or_path", str(model_dir), "--data.dataset", str(data_dir),
            "--data.input_key", "prompt", "--data.output_key", "response", "--data.apply_chat_template",
            "--data.max_len", "48", "--train.batch_size", "8", "--train.micro_batch_size", "8",
            "--train.max_epochs", "1", "--adam.lr", "1e-3", "--ckpt.output_dir", str(out_dir),
            "--eval.dataset", str(data_dir), "--eval.split", "test", "--logger.logging_steps", "1", *map(str, extra)]


def weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def assert_same_weights(a, b, atol=1e-6):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=k)
