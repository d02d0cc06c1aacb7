"""Shared fixtures. `tiny_model_dir`: a llama "nano" (~1M params) causal LM + tokenizer built
once per session with `build_tiny` (seed 0), loadable with `from_pretrained`."""
import pytest
from hypothesis import settings

# Property tests draw the same examples on every run, so CI results do not depend on luck.
settings.register_profile("posttrain", derandomize=True, deadline=None)
settings.load_profile("posttrain")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("tiny") / "llama-nano"
    build_tiny(path, arch="llama", size="nano", head="lm", seed=0, verbose=False)
    return str(path)
