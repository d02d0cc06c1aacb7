"""Which engine the rollout engines run (`posttrain.config.backends.rollout_backend`): vLLM where
`--vllm.num_engines` asks for engines and this machine runs vLLM, the HF engine with the reason otherwise;
`--rollout.engine vllm` turns the reason into a one-line ConfigError, `--rollout.engine hf` always serves HF;
partial rollout runs on vLLM (its async engine pauses and resumes requests), except with a LoRA adapter
synced as a vLLM adapter."""
import json

import pytest

from posttrain.config import ConfigError, backends, parse_config


def ppo(model, *flags):
    return parse_config("ppo",
                        ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", "x", *flags],
                        check=False)


@pytest.fixture
def vlm_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2_5_VLForConditionalGeneration"],
                                                      "vision_config": {}}))
    return tmp_path


def test_the_engine_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)
    assert backends.rollout_backend(ppo(tmp_path)) == ("hf", "--vllm.num_engines is unset")
    backend, why = backends.rollout_backend(ppo(tmp_path, "--vllm.num_engines", "2"))
    assert backend == "vllm" and why.startswith("--rollout.engine auto, vLLM's ")  # printed at start-up
    assert backends.rollout_backend(ppo(tmp_path, "--vllm.num_engines", "2", "--rollout.engine", "hf")) == (
        "hf", "--rollout.engine hf")
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: "vLLM is not installed")
    assert (backends.rollout_backend(ppo(tmp_path, "--vllm.num_engines", "1"))
            == ("hf", "vLLM is not installed"))
    with pytest.raises(ConfigError, match="--rollout.engine vllm: vLLM is not installed"):
        backends.rollout_backend(ppo(tmp_path, "--vllm.num_engines", "1", "--rollout.engine", "vllm"))


def test_a_vision_model_without_torchvision_samples_with_the_hf_engine(monkeypatch, vlm_folder):
    """vLLM's Qwen2-VL code needs torchvision, which the CPU setup cannot have: auto serves the HF engine and
    says why; --rollout.engine vllm ends in one line naming the way out."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real(name, *a))
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)
    backend, why = backends.rollout_backend(ppo(vlm_folder, "--vllm.num_engines", "1"))
    assert backend == "hf" and "without torchvision" in why and "--rollout.engine hf" in why
    with pytest.raises(ConfigError, match="--rollout.engine vllm: vLLM cannot load the vision-language "
                                          "model"):
        backends.rollout_backend(ppo(vlm_folder, "--vllm.num_engines", "1", "--rollout.engine", "vllm"))


PARTIAL = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "x", "--vllm.num_engines", "1",
           "--train.async_enable", "--train.partial_rollout_enable"]


def backend(*extra):
    return backends.rollout_backend(parse_config("ppo", [*PARTIAL, *extra], check=False))


def test_partial_rollout_runs_on_vllm_and_an_adapter_synced_lora_keeps_the_hf_engine(monkeypatch):
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)  # a machine that runs vLLM
    assert backend()[0] == "vllm"
    assert backend("--ds.lora.rank", "8", "--vllm.lora_sync", "merged")[0] == "vllm"
    kind, why = backend("--ds.lora.rank", "8", "--vllm.lora_sync", "adapter")
    assert kind == "hf" and why.endswith("use --vllm.lora_sync merged")
    with pytest.raises(ConfigError, match=r"^--rollout.engine vllm: --train.partial_rollout_enable with "
                                          r"--vllm.lora"):
        backend("--ds.lora.rank", "8", "--vllm.lora_sync", "adapter", "--rollout.engine", "vllm")


def test_the_hybrid_engine_runs_vllm(monkeypatch, tmp_path):
    """--train.colocate_all (OpenRLHF's hybrid engine) no longer sends the engines to the HF engine: they
    sleep between rollouts instead (--vllm.enable_sleep)."""
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)
    hybrid = ppo(tmp_path, "--vllm.num_engines", "2", "--actor.num_gpus_per_node", "2",
                 "--train.colocate_all", "--vllm.enable_sleep")
    assert backends.rollout_backend(hybrid)[0] == "vllm"


def test_sleep_level_acts_only_with_enable_sleep(tmp_path):
    from posttrain.config import inert_flags

    notes = inert_flags(ppo(tmp_path, "--vllm.sleep_level", "2"), "cpu")
    assert any(n.startswith("--vllm.sleep_level 2 has no effect here: needs --vllm.enable_sleep")
               for n in notes)
    with pytest.raises(ConfigError, match="--vllm.sleep_level"):
        parse_config("ppo", ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "x",
                             "--vllm.sleep_level", "3"])
