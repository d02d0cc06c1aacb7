"""The vLLM rollout engine on a real GPU: token ids in and out, the processed (temperature-scaled)
log-probs equal the trainer's recomputation, seeds make samples reproducible, and a weight sync
changes what the engine samples to exactly the new weights' distribution."""
import pytest
import torch

PROMPTS = [[5, 6, 7, 8, 9], [14, 15], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def engine(gpu_model_dir):
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(str(gpu_model_dir), dtype="float32",
                             gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=64)


def recomputed(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=ids.device)[:, None])[:, 0].tolist()


def test_logprobs_equal_the_trainers_recomputation(engine, gpu_model_dir, cuda):
    from posttrain.models import load_causal_lm
    from posttrain.rollout import SamplingParams

    model = load_causal_lm(str(gpu_model_dir), dtype="fp32").to(cuda).eval()
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=12, seed=3)
    outs = engine.generate(PROMPTS, params)
    for group, prompt in zip(outs, PROMPTS):
        for o in group:
            assert o.prompt_token_ids == prompt and len(o.logprobs) == len(o.output_token_ids) >= 1
            assert o.logprobs == pytest.approx(recomputed(model, prompt, o.output_token_ids, 0.8), abs=2e-3)
    again = engine.generate(PROMPTS, params)
    assert [o.output_token_ids for g in outs for o in g] == [o.output_token_ids for g in again for o in g]


def test_a_weight_sync_samples_from_the_new_weights(engine, gpu_model_dir, cuda):
    from posttrain.models import load_causal_lm
    from posttrain.rollout import SamplingParams

    new = load_causal_lm(str(gpu_model_dir), dtype="fp32").to(cuda).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(new)  # bucket-by-bucket through vLLM's load_weights, then the prefix cache reset
    engine.weights_updated(1)
    params = SamplingParams(temperature=1.0, n=1, max_new_tokens=12, seed=5)
    for group, prompt in zip(engine.generate(PROMPTS, params), PROMPTS):
        o = group[0]
        assert o.logprobs == pytest.approx(recomputed(new, prompt, o.output_token_ids, 1.0), abs=2e-3)
