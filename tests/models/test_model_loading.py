"""load_tokenizer / load_causal_lm / load_score_model / save_pretrained."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.models import (
    build_tiny,
    forward_logits,
    forward_values,
    load_causal_lm,
    load_score_model,
    load_tokenizer,
    parse_dtype,
    save_pretrained,
)

IDS = torch.tensor([[5, 17, 230, 41, 9, 88]])


def test_missing_path_message(tmp_path):
    missing = str(tmp_path / "no-such-model")
    for load in (load_tokenizer, load_causal_lm, load_score_model):
        with pytest.raises(FileNotFoundError) as err:
            load(missing)
        assert missing in str(err.value) and "not found" in str(err.value)
        assert "posttrain init-tiny --output DIR" in str(err.value)


def test_dtype_and_attention_choice(tiny_model_dir):
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match=r"dtype='int8'.*fp32, bf16, fp16"):
        parse_dtype("int8")
    model = load_causal_lm(tiny_model_dir, "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"
    eager = load_causal_lm(tiny_model_dir, "fp32", attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    assert forward_logits(model, {"input_ids": IDS}).dtype == torch.float32


def test_tokenizer_pad_fallback_and_template_override(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    assert tok.padding_side == "right" and tok.pad_token == "<|endoftext|>"
    folder = tmp_path / "nopad"
    shutil.copytree(tiny_model_dir, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["pad_token"]
    cfg["padding_side"] = "left"
    cfg_path.write_text(json.dumps(cfg))
    nopad = load_tokenizer(folder)
    assert nopad.pad_token == nopad.eos_token == "<|im_end|>" and nopad.padding_side == "right"

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    msgs = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(tiny_model_dir, chat_template=template).apply_chat_template(
        msgs, tokenize=False) == "[user] hi\n"
    (tmp_path / "t.jinja").write_text(template)
    assert load_tokenizer(tiny_model_dir, chat_template=str(tmp_path / "t.jinja")).apply_chat_template(
        msgs, tokenize=False) == "[user] hi\n"


def test_score_model_value_head_prefix(tmp_path):
    src = tmp_path / "rm"
    build_tiny(src, size="nano", head="score", seed=5, verbose=False)
    # re-save the checkpoint with its head named "value_head" (OpenRLHF-style)
    renamed = tmp_path / "rm-value-head"
    shutil.copytree(src, renamed)
    weights = load_file(str(src / "model.safetensors"))
    head = weights.pop("score.weight")
    weights["value_head.weight"] = head
    save_file(weights, str(renamed / "model.safetensors"), metadata={"format": "pt"})

    torch.manual_seed(0)
    rm = load_score_model(renamed, "fp32", value_head_prefix="value_head")
    assert torch.equal(rm.score.weight, head)
    reference = load_score_model(src, "fp32")
    with torch.no_grad():
        torch.testing.assert_close(forward_values(rm, {"input_ids": IDS}),
                                   forward_values(reference, {"input_ids": IDS}), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"value_head_prefix='critic_head'.*no tensor critic_head.weight"):
        load_score_model(renamed, "fp32", value_head_prefix="critic_head")


def test_score_model_from_causal_lm_gets_new_head(tiny_model_dir):
    torch.manual_seed(1)
    a = load_score_model(tiny_model_dir, "fp32")
    lm = load_causal_lm(tiny_model_dir, "fp32")
    assert torch.equal(a.model.embed_tokens.weight, lm.model.embed_tokens.weight)  # same backbone
    assert a.score.weight.shape == (1, lm.config.hidden_size)
    lora_rm = load_score_model(tiny_model_dir, "fp32", lora={"rank": 2, "target_modules": ["q_proj"]})
    trainable = [n for n, p in lora_rm.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable)  # the fresh head trains with the adapters
    assert all("lora_" in n or "score" in n for n in trainable)


class Wrapper(torch.nn.Module):  # stands in for DDP / a DeepSpeed engine
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_save_pretrained_unwraps_and_is_atomic(tiny_model_dir, tmp_path):
    model, tok = load_causal_lm(tiny_model_dir, "fp32"), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
        want = forward_logits(model, {"input_ids": IDS})
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    save_pretrained(Wrapper(model), tok, out)
    assert (out / "stale.bin").read_text() == "old"  # other files of a run directory are kept
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(os.listdir(out))
    assert sorted(os.listdir(tmp_path)) == ["export"]  # no temp folders left behind
    reloaded = load_causal_lm(out, "fp32")
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(reloaded, {"input_ids": IDS}), want, atol=0, rtol=0)

    class Boom:
        def save_pretrained(self, path):
            (path / "partial.txt").write_text("x")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_pretrained(model, Boom(), out)
    assert (out / "model.safetensors").exists() and not (out / "partial.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_gradient_checkpointing_same_logits_and_grads(tiny_model_dir):
    plain = load_causal_lm(tiny_model_dir, "fp32")
    ckpt = load_causal_lm(tiny_model_dir, "fp32", gradient_checkpointing=True)
    assert ckpt.model.gradient_checkpointing and not plain.model.gradient_checkpointing
    grads = []
    for m in (plain, ckpt):
        m.train()
        forward_logits(m, {"input_ids": IDS}).logsumexp(-1).sum().backward()
        grads.append(m.model.layers[0].mlp.up_proj.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)
