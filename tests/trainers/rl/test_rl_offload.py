"""--ref.offload / --reward.offload on whole models (no ZeRO-3): on an accelerator the reference and the
reward model wait in CPU memory between forwards and compute what a model kept on the GPU does; on a CPU
there is nothing to offload to (start-up says so: tests/unit/config/test_hardware_summary.py). ZeRO-3
shards offload through DeepSpeed's offload_param (`engines.zero3.FrozenShards`)."""
import pytest
import torch
from zero3_roles_worker import BATCHES, SEQUENCES, config, experience

from posttrain.models import load_tokenizer
from posttrain.rewards.reward_model import RewardModelSource
from posttrain.trainers.rl import build


def _device_of(model) -> str:
    return next(model.parameters()).device.type


def test_offload_on_a_cpu_leaves_the_models_where_they_are(tiny_model_dir, tiny_score_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    cfg = config(tiny_model_dir, tiny_score_model_dir, "--ref.offload", "--reward.offload")
    ref = build.build_reference(cfg, tok, torch.device("cpu"))
    source = build.build_reward_source(cfg, tok, torch.device("cpu"))
    assert not ref.offload and not source.offload and source.engine is None
    assert _device_of(ref.model) == _device_of(source.model) == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: offload moves a model between GPU and CPU memory")
def test_offloaded_reference_and_reward_model_wait_in_cpu_memory_and_compute_as_kept_ones(
        tiny_model_dir, tiny_score_model_dir):
    cuda = torch.device("cuda", 0)
    tok = load_tokenizer(tiny_model_dir)
    kept_cfg = config(tiny_model_dir, tiny_score_model_dir)
    off_cfg = config(tiny_model_dir, tiny_score_model_dir, "--ref.offload", "--reward.offload")
    exp = experience(SEQUENCES[:5], tok.pad_token_id)
    kept, off = build.build_reference(kept_cfg, tok, cuda), build.build_reference(off_cfg, tok, cuda)
    assert off.offload and _device_of(off.model) == "cpu" and _device_of(kept.model) == "cuda"
    assert torch.allclose(off.logprobs(exp, BATCHES), kept.logprobs(exp, BATCHES), atol=1e-6, rtol=0)
    assert _device_of(off.model) == "cpu"  # back in CPU memory after the call
    kept, off = build.build_reward_source(kept_cfg, tok, cuda), build.build_reward_source(off_cfg, tok, cuda)
    assert off.offload and _device_of(off.model) == "cpu" and _device_of(kept.model) == "cuda"
    assert isinstance(off, RewardModelSource)
    assert torch.allclose(off.score_tokens(SEQUENCES).rewards, kept.score_tokens(SEQUENCES).rewards,
                          atol=1e-6, rtol=0)
    assert _device_of(off.model) == "cpu"
