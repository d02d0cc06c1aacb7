"""build_tiny: HF-loadable folders, tokenizer behaviour, determinism, argument errors."""
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from posttrain.models import build_tiny

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_build_loads_with_auto_classes(tmp_path, arch):
    summary = build_tiny(tmp_path / arch, arch=arch, size="nano", verbose=False)
    tok = AutoTokenizer.from_pretrained(summary["path"])
    model = AutoModelForCausalLM.from_pretrained(summary["path"])
    assert model.config.model_type == arch
    assert summary["vocab_size"] == len(tok) == model.config.vocab_size
    assert 1000 <= len(tok) <= 4096
    assert summary["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert 0.8e6 < summary["num_parameters"] < 1.3e6  # "nano" ~1M
    assert model.config.max_position_embeddings >= 2048
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id and model.config.eos_token_id == tok.eos_token_id
    assert tok.eos_token_id in model.generation_config.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    out = model.generate(torch.tensor([tok.encode("What is 2 + 3?")]), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 7


def test_score_head_loads_as_sequence_classifier(tmp_path):
    path = tmp_path / "rm"
    build_tiny(path, arch="qwen2", size="nano", head="score", seed=3, verbose=False)
    saved = load_file(str(path / "model.safetensors"))["score.weight"]
    torch.manual_seed(123)  # a head missing from the checkpoint would be drawn from this RNG
    model = AutoModelForSequenceClassification.from_pretrained(path)
    assert model.config.num_labels == 1 and model.score.out_features == 1
    assert torch.equal(model.score.weight, saved)
    scores = model(input_ids=torch.tensor([[5, 6, 7], [8, 9, model.config.pad_token_id]])).logits
    assert scores.shape == (2, 1)


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = build_tiny(tmp_path / "a", size="nano", seed=7, verbose=False)["path"]
    b = build_tiny(tmp_path / "b", size="nano", seed=7, verbose=False)["path"]
    c = build_tiny(tmp_path / "c", size="nano", seed=8, verbose=False)["path"]
    wa, wb, wc = (load_file(f"{p}/model.safetensors") for p in (a, b, c))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    # one tokenizer for every seed, so models built with different seeds share a vocabulary
    assert (Path(a) / "tokenizer.json").read_text() == (Path(c) / "tokenizer.json").read_text()


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_tokenizer_round_trips_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_examples(tokenizer):
    text = "What is 23 + 58? Café 日本語 😀\n\t  two  spaces <|im_start|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # specials stay one token
    digits = tokenizer.convert_ids_to_tokens(tokenizer.encode("12345"))
    assert digits == ["1", "2", "3", "4", "5"]  # one token per digit
    assert len(tokenizer.encode(" the answer is")) == 3  # common words are single tokens


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                    "<|im_start|>assistant\n5<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == text[: text.index("5<|im_end|>")]
    assert tokenizer.apply_chat_template(CHAT[:2], tokenize=False).endswith("<|im_end|>\n")
    ids = tokenizer.encode(text)
    assert ids.count(tokenizer.eos_token_id) == 3


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"arch='gpt2'.*llama.*qwen2"):
        build_tiny(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match=r"size='huge'.*nano"):
        build_tiny(tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match=r"head='value'"):
        build_tiny(tmp_path / "x", head="value")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        build_tiny(tmp_path / "full", size="nano", verbose=False)
    assert (tmp_path / "full" / "keep.txt").exists()
