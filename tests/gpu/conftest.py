"""GPU tests: they need a CUDA GPU and vLLM (`pip install -e '.[vllm]'`); elsewhere every test
here is skipped with that reason. `bash tests/gpu/run.sh` runs them in one go on a GPU machine."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    from posttrain.config.backends import vllm_unavailable

    why = vllm_unavailable()
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {why}")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_model_dir(tmp_path_factory):
    """A llama "nano" policy with a trained-from-nothing tokenizer, saved in HF format (fp32)."""
    from posttrain.models import build_tiny

    d = tmp_path_factory.mktemp("gpu_policy")
    build_tiny(str(d), arch="llama", size="nano", head="lm", seed=0, verbose=False, overwrite=True)
    return d


@pytest.fixture(scope="session")
def cuda():
    return torch.device("cuda", 0)
