"""The Ray rollout-engine process (`EngineWorker`) without Ray, over the real vLLM (its CPU build here):
`setup` with a parsed ppo config builds a vLLM engine from the OpenRLHF flags; a verified `load_numpy` records
the hash of what arrived, equal to the trainer's; the engine then samples from the received weights (the
trainer's log-probs of those weights)."""
import pytest
import torch

from posttrain.config.backends import vllm_unavailable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_unavailable() is not None, reason=f"real vLLM: {vllm_unavailable()}")]


def test_engine_worker_builds_a_real_vllm_engine_from_the_flags(tiny_model_dir):
    from posttrain.config import parse_config
    from posttrain.models import load_causal_lm
    from posttrain.rollout import SamplingParams
    from posttrain.trainers.rl.placement.workers import EngineWorker, numpy_state
    from posttrain.utils.weights_hash import weights_hash
    from tests.rollout.test_vllm_real import TOL, check_logprobs, perturbed

    argv = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", "x",
            "--vllm.num_engines", "1", "--vllm.gpu_memory_utilization", "0.3", "--vllm.enforce_eager",
            "--ds.param_dtype", "fp32", "--data.max_len", "96", "--train.seed", "5"]
    worker = EngineWorker(1, {})
    worker.setup(parse_config("ppo", argv, check=False))
    assert worker.backend_name()[0] == "vllm"
    config = worker.engine.llm.llm_engine.vllm_config
    mc = config.model_config
    assert (mc.model, mc.dtype, mc.max_model_len, mc.seed, mc.enforce_eager, mc.logprobs_mode,
            config.parallel_config.tensor_parallel_size) == (
        str(tiny_model_dir), torch.float32, 96, 5, True, "processed_logprobs", 1)
    assert worker.engine.eos_token_ids == [2]  # the tokenizer's eos, as the HF engine's default
    assert worker.weights_hash() is None  # nothing received yet: vLLM cannot be hashed by HF name

    new = perturbed(tiny_model_dir)
    state = new.state_dict()
    worker.load_numpy(numpy_state(state), verify=True, version=1)
    assert worker.weights_hash() == weights_hash(state)
    prompts = [[5, 6, 7, 8, 9], [14, 15]]
    outs = worker.generate(prompts, SamplingParams(temperature=0.8, n=2, max_new_tokens=8), [8, 5], [3, 4])
    assert [[len(o.output_token_ids) <= b for o in g] for g, b in zip(outs, [8, 5])] == [[True] * 2] * 2
    check_logprobs(outs, prompts, new, 0.8, TOL["cuda" if torch.cuda.is_available() else "cpu"])
    original = load_causal_lm(str(tiny_model_dir), dtype="fp32").eval()
    with pytest.raises(AssertionError):  # not the weights it was built with any more
        check_logprobs(outs, prompts, original, 0.8, 1e-3)
    worker.load_numpy(numpy_state(original.state_dict()))  # unverified: no stale record
    assert worker.weights_hash() is None
