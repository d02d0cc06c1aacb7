"""A real vLLM engine with `tensor_parallel_size=2` (on the CPU build: two worker processes of vLLM's `mp`
executor, gloo): its greedy samples equal those of a `tensor_parallel_size=1` engine, and a weight sync
reaches both workers: afterwards its greedy samples are the new weights' argmax (a worker left with the old
shard would give other tokens). Also the PPO engine worker's arguments for it, and its refusal on GPUs."""
import gc

import pytest
import torch

from posttrain.config.backends import vllm_unavailable

real_vllm = pytest.mark.skipif(vllm_unavailable() is not None, reason=f"real vLLM: {vllm_unavailable()}")

PROMPTS = [[5, 6, 7, 8, 9], [14, 15], [20, 21, 22, 23]]
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=64, kv_cache_memory_bytes=2**26, seed=0)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("vllm-tp") / "qwen2-nano"  # 4 heads, 2 kv heads: splits over 2 ranks
    build_tiny(path, arch="qwen2", size="nano", seed=0, verbose=False)
    return str(path)


def greedy(engine):
    from posttrain.rollout import SamplingParams

    outs = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    return [g[0].output_token_ids for g in outs]


def recomputed(model, prompt, tokens) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def argmax_tokens(model, prompt, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return logits.argmax(-1).tolist()


@pytest.fixture(scope="module")
def one_rank_greedy(qwen2_dir):
    """The greedy samples of a `tensor_parallel_size=1` engine (core in this process), built once for the
    module: what both cases' engines must sample."""
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        one = VLLMRolloutEngine(qwen2_dir, **ENGINE)
        expected = greedy(one)
        del one
        gc.collect()
    return expected


@pytest.mark.slow
@pytest.mark.e2e
@real_vllm
@pytest.mark.parametrize("core", ["own process", "this process"])
def test_tensor_parallel_engine_samples_as_one_rank_and_takes_weight_syncs(qwen2_dir, one_rank_greedy, core,
                                                                           monkeypatch):
    """The engine core in a process of its own (vLLM's default: buckets cross as bytes) or in this one
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the Ray engine worker builds it)."""
    from posttrain.models import load_causal_lm
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    expected = one_rank_greedy
    if core == "own process":
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = VLLMRolloutEngine(qwen2_dir, tensor_parallel_size=2, **ENGINE)
    assert engine.llm.collective_rpc("posttrain_model_class") == ["Qwen2ForCausalLM"] * 2  # two workers
    assert greedy(engine) == expected
    new = load_causal_lm(qwen2_dir, dtype="fp32").eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    engine.load_weights(new)
    out = greedy(engine)
    assert out != expected
    assert all(argmax_tokens(new, p, o) == o for p, o in zip(PROMPTS, out))
    sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=3))
    gap = max(max(abs(a - b) for a, b in zip(o.logprobs, recomputed(new, p, o.output_token_ids)))
              for group, p in zip(sampled, PROMPTS) for o in group)
    assert gap < 5e-3  # measured ~1e-3 in fp32, as with one rank
    engine.llm.llm_engine.engine_core.shutdown()


def test_ppo_engines_run_tensor_parallel_on_cpus_and_refuse_it_on_gpus(monkeypatch, tiny_model_dir):
    """--vllm.tensor_parallel_size 2 gives the engine vLLM's `mp` executor with 2 ranks; on a GPU the run
    stops at start-up (validation, before Ray places anything) with one line naming the flag and the way
    out."""
    from posttrain.config import ConfigError, parse_config, validate
    from posttrain.rollout.engine_builder import vllm_engine_kwargs

    argv = ["--actor.model_name_or_path", tiny_model_dir, "--data.prompt_dataset", "x",
            "--vllm.num_engines", "1", "--reward.remote_url", "r.py"]
    one = vllm_engine_kwargs(parse_config("ppo", argv, check=False))
    assert (one["tensor_parallel_size"], one["distributed_executor_backend"]) == (1, "uni")
    cfg = parse_config("ppo", argv + ["--vllm.tensor_parallel_size", "2"], check=False)
    two = vllm_engine_kwargs(cfg)
    assert (two["tensor_parallel_size"], two["distributed_executor_backend"]) == (2, "mp")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match=r"^--vllm.tensor_parallel_size 2: .* runs on CPUs .*not on GPUs.*"
                                          r"use --vllm.tensor_parallel_size 1 and more --vllm.num_engines$"):
        validate(cfg, device="cuda")
