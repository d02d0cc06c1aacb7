"""Which rollout backend a run gets (`config/backends.py`): partial rollout runs on vLLM (its async
engine pauses and resumes requests), except with a LoRA adapter synced as a vLLM adapter."""
import pytest

from posttrain.config import ConfigError, backends, parse_config

PARTIAL = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "x", "--vllm.num_engines", "1",
           "--train.async_enable", "--train.partial_rollout_enable"]


def backend(*extra):
    return backends.rollout_backend(parse_config("ppo", [*PARTIAL, *extra], check=False))


def test_partial_rollout_runs_on_vllm_and_an_adapter_synced_lora_keeps_the_hf_engine(monkeypatch):
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)  # a machine that runs vLLM
    assert backend() == ("vllm", "")
    assert backend("--ds.lora.rank", "8", "--vllm.lora_sync", "merged") == ("vllm", "")
    kind, why = backend("--ds.lora.rank", "8", "--vllm.lora_sync", "adapter")
    assert kind == "hf" and why.endswith("use --vllm.lora_sync merged")
    with pytest.raises(ConfigError, match=r"^--rollout.engine vllm: --train.partial_rollout_enable with --vllm.lora"):
        backend("--ds.lora.rank", "8", "--vllm.lora_sync", "adapter", "--rollout.engine", "vllm")
