"""`rollout.engine_builder.build_rollout_engine`: the one place an RL run's engine is built from its config,
for the one-process trainer (over the actor's own module) and the Ray engine workers (an engine
of its own)."""
import copy

import pytest

from posttrain.config import parse_config
from posttrain.models import is_peft
from posttrain.rollout import HFRolloutEngine, resolve_eos_ids
from posttrain.rollout.engine_builder import build_rollout_engine


def ppo(tiny_model_dir, *flags):
    return parse_config("ppo", ["--actor.model_name_or_path", str(tiny_model_dir),
                                "--data.prompt_dataset", "x", "--reward.remote_url", "r.py", *flags],
                        check=False)


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_hf_over_the_actors_module_or_over_its_own_copy(model, tokenizer, tiny_model_dir, mode):
    cfg = ppo(tiny_model_dir, "--ds.lora.rank", "4", "--vllm.lora_sync", mode)
    shared = build_rollout_engine(cfg, tokenizer, "hf", model, shared=True)
    assert isinstance(shared, HFRolloutEngine) and shared.model is model  # samples the trainer's module
    assert shared.lora_sync is None and shared.pad_token_id == tokenizer.pad_token_id
    own = build_rollout_engine(cfg, tokenizer, "hf", copy.deepcopy(model))
    assert own.lora_sync == mode and is_peft(own.model) is (mode == "adapter")  # takes the adapter by sync


@pytest.fixture
def recorded(monkeypatch):
    """The vLLM engine classes replaced by recorders of what they were built with: {class
    name: (path, kwargs)}."""
    from posttrain.rollout import vllm_async_engine, vllm_engine

    built = {}
    for module, name in ((vllm_engine, "VLLMRolloutEngine"), (vllm_async_engine, "VLLMAsyncRolloutEngine")):
        monkeypatch.setattr(module, name, lambda path, name=name, **kw: built.setdefault(name, (path, kw)))
    # the factory's setting, kept out of this process
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return built


@pytest.mark.parametrize("flags,cls", [((), "VLLMRolloutEngine"),
                                       (("--train.async_enable",), "VLLMAsyncRolloutEngine"),
                                       (("--train.agent_func_path", "a.py"), "VLLMAsyncRolloutEngine")])
def test_vllm_offline_or_async_from_the_flags(recorded, tokenizer, tiny_model_dir, flags, cls):
    cfg = ppo(tiny_model_dir, "--vllm.num_engines", "1", "--data.max_len", "96", "--train.seed", "5", *flags)
    build_rollout_engine(cfg, tokenizer, "vllm")
    assert list(recorded) == [cls]
    path, kw = recorded[cls]
    assert path == str(tiny_model_dir) and kw["eos_token_ids"] == resolve_eos_ids(tokenizer)
    assert (kw["max_model_len"], kw["seed"], kw["distributed_executor_backend"]) == (96, 5, "uni")
    assert "lora" not in kw and "lora_sync" not in kw


def test_vllm_takes_a_lora_actors_spec_and_sync_mode(recorded, tokenizer, tiny_model_dir):
    cfg = ppo(tiny_model_dir, "--vllm.num_engines", "1", "--ds.lora.rank", "4", "--vllm.lora_sync", "merged")
    build_rollout_engine(cfg, tokenizer, "vllm")
    _, kw = recorded["VLLMRolloutEngine"]
    assert kw["lora"].rank == 4 and kw["lora_sync"] == "merged"


def test_refusals(model, tokenizer, tiny_model_dir):
    cfg = ppo(tiny_model_dir)
    with pytest.raises(ValueError, match="the HF engine needs the model"):
        build_rollout_engine(cfg, tokenizer, "hf")
    with pytest.raises(ValueError, match="valid are 'hf', or 'vllm' with an engine of its own"):
        build_rollout_engine(cfg, tokenizer, "vllm", model, shared=True)
    with pytest.raises(ValueError, match="backend='sglang'"):
        build_rollout_engine(cfg, tokenizer, "sglang", model)
