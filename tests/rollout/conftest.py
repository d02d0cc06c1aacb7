"""Fixtures for the rollout-engine tests: the session's nano llama (vocab 1972, pad 0, eos 2,
generation-config eos [2, 0]) loaded once per module, fp32, and an engine over it."""
import pytest


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from posttrain.models import load_causal_lm

    return load_causal_lm(tiny_model_dir, dtype="fp32").eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    from posttrain.rollout import HFRolloutEngine

    return HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id)
