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
from posttrain.models.loading import ModelLoadError

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


def test_score_model_from_causal_lm_gets_new_head_only_when_asked(tiny_model_dir):
    torch.manual_seed(1)
    a = load_score_model(tiny_model_dir, "fp32", new_head_ok=True)
    lm = load_causal_lm(tiny_model_dir, "fp32")
    assert torch.equal(a.model.embed_tokens.weight, lm.model.embed_tokens.weight)  # same backbone
    assert a.score.weight.shape == (1, lm.config.hidden_size)
    lora_rm = load_score_model(tiny_model_dir, "fp32", lora={"rank": 2, "target_modules": ["q_proj"]},
                               new_head_ok=True)
    trainable = [n for n, p in lora_rm.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable)  # the fresh head trains with the adapters
    assert all("lora_" in n or "score" in n for n in trainable)


def copy_without(src, dst, *names):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(*names))
    return dst


def as_bin(src, dst, architecture=None):
    """`src` with its weights as pytorch_model.bin (no safetensors headers to inspect before loading)."""
    copy_without(src, dst, "model.safetensors")
    torch.save(load_file(os.path.join(src, "model.safetensors")), dst / "pytorch_model.bin")
    if architecture:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["architectures"] = [architecture]
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_folder_with_only_a_tokenizer_is_refused_before_loading(tiny_model_dir, tmp_path):
    only_tok = copy_without(tiny_model_dir, tmp_path / "tok-only", "model.safetensors", "config.json",
                            "generation_config.json")
    assert load_tokenizer(only_tok).pad_token  # the tokenizer itself is fine
    for load in (load_causal_lm, load_score_model):
        with pytest.raises(ModelLoadError) as err:
            load(only_tok, "fp32")
        msg = str(err.value)
        assert msg.startswith(f"model folder {only_tok} has no model config.json and no weights")
        assert "(it holds only tokenizer files)" in msg and "posttrain init-tiny" in msg
    no_weights = copy_without(tiny_model_dir, tmp_path / "no-weights", "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"no-weights has no model weights \(model.safetensors"):
        load_causal_lm(no_weights)


def test_tokenizer_larger_than_the_vocabulary_is_refused(tiny_model_dir, tmp_path):
    folder = copy_without(tiny_model_dir, tmp_path / "more-tokens")
    tok = load_tokenizer(folder)
    rows = len(tok)
    tok.add_tokens(["<extra_1>", "<extra_2>"])
    tok.save_pretrained(folder)
    for load in (load_causal_lm, lambda p: load_score_model(p, new_head_ok=True)):
        with pytest.raises(ModelLoadError) as err:
            load(folder)
        assert str(err.value).startswith(f"tokenizer {folder} has {rows + 2} tokens but model {folder} has a "
                                         f"vocabulary of {rows} (input embedding rows)")
    with pytest.raises(ModelLoadError, match=f"has {rows + 2} tokens but model {tiny_model_dir} has a "
                                             f"vocabulary of {rows}"):
        load_causal_lm(tiny_model_dir, tokenizer=tok)  # the run's tokenizer against another folder's model
    smaller = load_tokenizer(tiny_model_dir)
    assert load_causal_lm(folder, tokenizer=smaller).config.vocab_size == rows  # fewer tokens are fine


def test_reward_model_given_as_causal_lm_is_refused(tiny_score_model_dir, tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_causal_lm(tiny_score_model_dir)
    assert str(err.value).startswith(f"model {tiny_score_model_dir} is a reward/score model (architecture "
                                     "LlamaForSequenceClassification), not a causal language model")
    assert "--reward.model_name_or_path" in str(err.value)
    # the architecture renamed: the weights still show a score head and no LM head
    relabelled = copy_without(tiny_score_model_dir, tmp_path / "relabelled")
    cfg = json.loads((relabelled / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (relabelled / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"its weights hold score.weight and no lm_head.weight"):
        load_causal_lm(relabelled)
    # no safetensors to inspect: transformers reports the LM head it had to initialise
    with pytest.raises(ModelLoadError, match=r"has no LM head \(lm_head.weight\)"):
        load_causal_lm(as_bin(tiny_score_model_dir, tmp_path / "bin", "LlamaForCausalLM"))


def test_causal_lm_given_as_reward_model_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_score_model(tiny_model_dir)
    msg = str(err.value)
    assert msg.startswith(f"model {tiny_model_dir} has no trained score head (no score.weight in its "
                          f"weights; architecture LlamaForCausalLM), so it is not a reward model")
    assert "posttrain rm" in msg
    with pytest.raises(ModelLoadError, match="no trained score head"):
        load_score_model(as_bin(tiny_model_dir, tmp_path / "bin"))  # found after loading, too
    assert load_score_model(tmp_path / "bin", new_head_ok=True).score.weight.shape[0] == 1


def test_head_under_another_name_is_named_in_the_refusal(tiny_score_model_dir, tmp_path):
    renamed = copy_without(tiny_score_model_dir, tmp_path / "value-head", "model.safetensors")
    weights = load_file(os.path.join(tiny_score_model_dir, "model.safetensors"))
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="its weights hold value_head.weight: pass "
                                             "--ds.value_head_prefix value_head"):
        load_score_model(renamed)
    assert torch.equal(load_score_model(renamed, value_head_prefix="value_head").score.weight,
                       weights["value_head.weight"])


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
    assert ({"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}
            <= set(os.listdir(out)))
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


def test_hub_kernels_are_off_unless_asked_for(tiny_model_dir, tiny_score_model_dir, monkeypatch):
    """transformers turns Hub kernels on by default when `kernels` is installed (on a GPU: remote code
    fetched at `train()`, an error offline); posttrain loads without them unless USE_HUB_KERNELS is set."""
    from posttrain.models.loading import hub_kernels_requested

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    assert not hub_kernels_requested()
    for model in (load_causal_lm(tiny_model_dir, "fp32"), load_score_model(tiny_score_model_dir, "fp32")):
        assert getattr(model, "use_kernels", False) is False
    for value, wanted in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("USE_HUB_KERNELS", value)
        assert hub_kernels_requested() is wanted


def test_an_unreachable_hub_id_is_one_line(monkeypatch):
    """A hub id with no hub: FileNotFoundError of one line (transformers' OSError adds a line of advice)."""
    import huggingface_hub.constants

    from posttrain.models.loading import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: the constant too
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # else ~45 s of connection retries
    with pytest.raises(FileNotFoundError, match="nosuchorg/nosuchmodel") as err:
        load_tokenizer("nosuchorg/nosuchmodel")
    assert "\n" not in str(err.value) and "init-tiny" in str(err.value)
