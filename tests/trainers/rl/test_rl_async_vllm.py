"""Async RL on Ray with real vLLM rollout engines (vLLM's CPU build here): the engine actor runs
`VLLMAsyncRolloutEngine` (vLLM's AsyncLLM), generates while the actor trains, takes the weight syncs with
partial rollout (pause, load, resume mid-request) and serves oversampled batches. The per-token version
bookkeeping itself: tests/rollout/test_vllm_async_engine.py."""
import pytest

from posttrain.utils.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def test_async_partial_rollout_with_oversampling_on_a_vllm_engine(run_ppo, ray_session, capfd):
    from posttrain.config.backends import vllm_unavailable

    if vllm_unavailable():
        pytest.skip(f"real vLLM: {vllm_unavailable()}")
    out, _ = run_ppo("--train.async_enable", "--train.partial_rollout_enable", "--algo.advantage.estimator",
                     "group_norm", "--train.num_episodes", "1", "--vllm.num_engines", "1",
                     "--rollout.vllm_generate_batch_size", "16", "--data.max_samples", "32",
                     "--vllm.enforce_eager", name="vllm_async")  # uncompiled: seconds less start-up
    err = capfd.readouterr().err
    assert "1 rollout engine(s): vllm" in err and "partial rollout (weights sync between decode steps)" in err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["rollout/generation_calls"] for r in rows] == [1, 0, 1, 0]  # 16 prompts per call, 8 per step
    assert all(r["async/staleness_max"] <= 2 for r in rows)  # a buffered group waits one more step
    assert all(r["rollout/policy_versions_per_sample"] >= 1.0 for r in rows)
    assert all(r["actor/policy_loss"] == r["actor/policy_loss"] for r in rows)
    assert (out / "model.safetensors").exists()
