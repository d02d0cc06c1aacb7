"""Shared fixtures. `tiny_model_dir`: a llama "nano" (~1M params) causal LM + tokenizer built
once per session with `build_tiny` (seed 0), loadable with `from_pretrained`; `tiny_score_model_dir`, its score-head twin. `one_torch_thread`:
request it (module scope) where tiny models run many small ops."""
import pytest
import torch
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


@pytest.fixture(scope="session")
def tiny_score_model_dir(tmp_path_factory):
    """A llama "nano" score model (reward model / critic, `score` head), seed 1; read-only: copy it
    before changing its files."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("tiny-rm") / "llama-nano-score"
    build_tiny(path, arch="llama", size="nano", head="score", seed=1, verbose=False)
    return str(path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread (and stay fast when other processes load the CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
