"""build_tiny: HF-loadable folders, tokenizer behaviour, determinism, argument errors; the shapes of
released models (their configs without weights; one small custom shape built, loaded, sampled, trained)."""
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from posttrain.models import SHAPES, ModelShape, build_tiny, forward_logits, load_causal_lm, model_config
from posttrain.rollout import HFRolloutEngine, SamplingParams

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


# From each model's published config.json, and its published parameter count (tied embeddings).
PUBLISHED = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, rms_norm_eps=1e-6,
                         rope={"rope_type": "default", "rope_theta": 1e6}, params=494_032_768),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, rms_norm_eps=1e-6,
                         rope={"rope_type": "default", "rope_theta": 1e6}, params=1_543_714_304),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, rms_norm_eps=1e-5,
                        rope={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192},
                        params=1_235_814_400),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_shape_configs_equal_the_released_models(name):
    """The config of each shape (no weights: the model is built on the meta device) has the released
    model's dimensions, rope and parameter count."""
    from transformers import AutoModelForCausalLM

    want = dict(PUBLISHED[name])
    config = model_config(SHAPES[name])
    assert config.model_type == want.pop("model_type") and config.tie_word_embeddings
    assert config.rope_parameters == want.pop("rope")
    params = want.pop("params")
    assert {k: getattr(config, k) for k in want} == want
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == params


@pytest.mark.parametrize("shape,dtype", [
    (ModelShape("qwen2", 64, 2, 4, 2, 128, 40000, rope_theta=1e6), "fp32"),
    (ModelShape("llama", 64, 2, 4, 2, 128, 40000, rope_theta=500000.0, rms_norm_eps=1e-5,
                rope_scaling=SHAPES["llama3.2-1b"].rope_scaling, max_position_embeddings=131072), "bf16"),
])
def test_a_shape_with_a_vocabulary_larger_than_the_tokenizer_loads_samples_and_trains(tmp_path, shape, dtype):
    summary = build_tiny(tmp_path / "m", shape=shape, dtype=dtype, verbose=False)
    assert summary["shape"] == "custom" and summary["arch"] == shape.arch and summary["vocab_size"] == 40000
    assert load_file(str(tmp_path / "m" / "model.safetensors"))["model.embed_tokens.weight"].dtype == (
        torch.bfloat16 if dtype == "bf16" else torch.float32)
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    model = load_causal_lm(tmp_path / "m")  # the tokenizer has fewer tokens than the embedding has rows
    assert len(tok) < model.config.vocab_size == 40000 and model.dtype == torch.float32
    # sampling reaches ids the tokenizer does not have; they decode to nothing rather than failing
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    out = engine.generate([tok.encode("What is 2 + 3?")], SamplingParams(max_new_tokens=8, n=2, seed=0))[0]
    ids = [t for o in out for t in o.output_token_ids]
    assert max(ids) >= len(tok) and isinstance(tok.decode(ids), str)
    # a training step on tokenizer ids: finite loss, gradient on every parameter
    model.train()
    ids = torch.tensor([tok.encode("What is 2 + 3? 5")])
    logits = forward_logits(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               and p.grad.any() for p in model.parameters())


def test_shape_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"shape='gpt5'.*qwen2.5-0.5b"):
        build_tiny(tmp_path / "x", shape="gpt5")
    with pytest.raises(ValueError, match="not both"):
        build_tiny(tmp_path / "x", shape="qwen2.5-0.5b", size="nano")
    with pytest.raises(ValueError, match="is a llama model"):
        build_tiny(tmp_path / "x", shape="llama3.2-1b", arch="qwen2")
    with pytest.raises(ValueError, match="dtype='fp16'"):
        build_tiny(tmp_path / "x", size="nano", dtype="fp16")
