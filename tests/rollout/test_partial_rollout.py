"""Partial rollout in the HF engine: weights loaded while samples are in flight. The rows in flight
continue with the new weights (re-prefilled), and every token keeps the log-prob of the version that
sampled it (recomputed here by a plain forward of each version)."""
import copy
import threading
import time

import pytest
import torch

from posttrain.rollout import HFRolloutEngine, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [14, 15], [20, 21, 22]]


def recomputed_logprobs(model, prompt, tokens, temperature):
    """log softmax(logits / T) of each sampled token, by one teacher-forced forward of `model`."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture
def two_versions(model):
    """The engine's model (version 0) and a perturbed copy of it (version 1)."""
    old = copy.deepcopy(model).eval()
    new = copy.deepcopy(model).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return old, new


@pytest.mark.parametrize("path", ["generate", "stream"])
def test_samples_span_two_versions_and_each_token_keeps_its_versions_logprob(two_versions, tokenizer, path):
    old, new = two_versions
    engine = HFRolloutEngine(copy.deepcopy(old), tokenizer, pad_token_id=tokenizer.pad_token_id)
    forwards = []

    def slow_forward(*args):  # a slow engine, counting its forwards
        forwards.append(1)
        time.sleep(0.03)

    slow = engine.model.register_forward_pre_hook(slow_forward)
    params = SamplingParams(temperature=0.9, n=2, max_new_tokens=24, stop_token_ids=(10**6,))
    result = {}

    def generate():
        if path == "generate":
            result["out"] = engine.generate(PROMPTS, params, seeds=[1, 2, 3])
        else:
            from posttrain.rollout.async_engine import generate_all
            result["out"] = generate_all(engine, PROMPTS, params, seeds=[1, 2, 3])

    worker = threading.Thread(target=generate)
    worker.start()
    deadline = time.time() + 60
    while len(forwards) < 4 and time.time() < deadline:  # a prefill and 3 decode steps: tokens of version 0
        time.sleep(0.005)
    with engine.paused():  # partial rollout's weight sync: between two decode steps
        engine.load_weights(new.state_dict())
        engine.weights_updated(1)
    worker.join(120)
    slow.remove()
    outs = [o for group in result["out"] for o in group]
    for o in outs:
        versions = o.policy_versions
        assert versions == sorted(versions) and set(versions) == {0, 1}, versions  # it spans both
        k = versions.index(1)
        expect = (recomputed_logprobs(old, o.prompt_token_ids, o.output_token_ids, 0.9)[:k]
                  + recomputed_logprobs(new, o.prompt_token_ids, o.output_token_ids, 0.9)[k:])
        assert o.logprobs == pytest.approx(expect, abs=2e-4)
    # the version-0 prefix differs from what version 1 would have given it (the check can fail)
    o = outs[0]
    k = o.policy_versions.index(1)
    assert recomputed_logprobs(new, o.prompt_token_ids, o.output_token_ids, 0.9)[:k] != pytest.approx(
        o.logprobs[:k], abs=2e-4)


def test_a_load_waits_for_the_decode_step_in_flight(model, tokenizer):
    engine = HFRolloutEngine(copy.deepcopy(model), tokenizer, pad_token_id=tokenizer.pad_token_id)
    inside, events = threading.Event(), []

    def slow_forward(*a):
        inside.set()
        events.append("forward start")
        time.sleep(0.2)
        events.append("forward end")

    hook = engine.model.register_forward_pre_hook(slow_forward)
    worker = threading.Thread(target=engine.generate, args=([PROMPTS[0]], SamplingParams(max_new_tokens=2)))
    worker.start()
    assert inside.wait(30)
    engine.load_weights(model.state_dict())
    events.append("loaded")
    worker.join(60)
    hook.remove()
    assert events.index("loaded") > events.index("forward end")


def test_rows_admitted_after_a_weight_load_join_rows_refreshed_with_it(two_versions, tokenizer):
    """Row a decodes 3 tokens with version 0; the weights change; row b joins: a is re-prefilled with
    version 1 (prompt + its tokens) and both continue, every token with its version's log-prob."""
    old, new = two_versions
    engine = HFRolloutEngine(copy.deepcopy(old), tokenizer, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(temperature=1.0, stop_token_ids=(10**6,))
    a = engine.sequences([PROMPTS[0]], params, [8], [1])[0]
    b = engine.sequences([PROMPTS[1]], params, [5], [2])[0]
    with engine.inference():
        batch = engine.decode_batch()
        batch.admit([a])
        for _ in range(3):
            batch.step()
        engine.load_weights(new.state_dict())
        engine.weights_updated(1)
        batch.admit([b])
        assert batch.refreshes == 1 and len(batch) == 2
        while len(batch):
            batch.step()
    assert a.versions == [0, 0, 0] + [1] * 5 and b.versions == [1] * 5
    expect_a = (recomputed_logprobs(old, a.prompt, a.tokens, 1.0)[:3] + recomputed_logprobs(new, a.prompt,
                                                                                            a.tokens,
                                                                                          1.0)[3:])
    assert a.logprobs == pytest.approx(expect_a, abs=2e-4)
    assert b.logprobs == pytest.approx(recomputed_logprobs(new, b.prompt, b.tokens, 1.0), abs=2e-4)


def test_a_ray_engine_process_takes_weights_while_it_generates(tiny_model_dir, monkeypatch):
    """The rollout-engine process (distributed/workers.EngineWorker, here without Ray; with partial
    rollout Ray gives it a second thread): a sync that arrives mid-`generate` loads between two decode
    steps and the samples continue with the new version (the HF engine, --rollout.engine hf; vLLM's:
    tests/rollout/test_vllm_async_engine.py)."""
    from posttrain.config import backends, parse_config
    from posttrain.trainers.rl.placement.workers import EngineWorker, numpy_state

    argv = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", "x",
            "--vllm.num_engines", "1", "--ds.param_dtype", "fp32", "--train.async_enable",
            "--train.partial_rollout_enable", "--rollout.engine", "hf"]
    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)  # as on a GPU node with vLLM
    worker = EngineWorker(1, {})
    worker.setup(parse_config("ppo", argv, check=False))
    assert worker.backend_name() == ("hf", "--rollout.engine hf")
    forwards = []

    def slow_forward(*args):
        forwards.append(1)
        time.sleep(0.03)

    hook = worker.engine.model.register_forward_pre_hook(slow_forward)
    params = SamplingParams(temperature=1.0, n=2, max_new_tokens=16, stop_token_ids=(10**6,))
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("out",
                                                               worker.generate(PROMPTS, params, None,
                                                                               [1, 2, 3])))
    thread.start()
    deadline = time.time() + 60
    while len(forwards) < 4 and time.time() < deadline:
        time.sleep(0.005)
    state = {k: v + 0.01 for k, v in worker.engine.model.state_dict().items()}
    worker.load_numpy(numpy_state(state), False, 7)
    thread.join(60)
    hook.remove()
    for group in result["out"]:
        for o in group:
            assert set(o.policy_versions) == {0, 7} and o.policy_versions == sorted(o.policy_versions)
