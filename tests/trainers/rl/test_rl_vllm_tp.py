"""PPO on Ray with one real vLLM engine split over 2 ranks (`--vllm.tensor_parallel_size 2`, vLLM's CPU
build): vLLM's `mp` executor starts its two worker processes inside the engine's Ray process (which holds the
first of the engine's 2 bundles), the start-up sync is hash-verified and the run trains 3 steps sampling on
it. That the engine has two ranks and a sync reaches both workers is checked on the engine itself
(test_vllm_real_tensor_parallel.py: vLLM's own start-up line comes through Ray's log streaming, which a long
test session may batch or deduplicate, so it is not asserted here)."""
import pytest

from posttrain.config.backends import vllm_unavailable
from posttrain.utils.metrics import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(vllm_unavailable() is not None, reason=f"real vLLM: {vllm_unavailable()}")]


def test_ppo_with_a_tensor_parallel_vllm_engine(run_ppo, ray_session, capfd):
    run, _ = run_ppo("--train.num_episodes", "1", "--data.max_samples", "24", "--rollout.batch_size", "8",
                     "--train.batch_size", "32", "--ds.param_dtype", "fp32", "--vllm.num_engines", "1",
                     "--vllm.tensor_parallel_size", "2", "--rollout.engine", "vllm", "--vllm.enforce_eager",
                     name="tp2")
    captured = capfd.readouterr()
    log = captured.out + captured.err
    assert "1 rollout engine(s): vllm" in log and "weight sync verified: 1 rollout engine(s)" in log
    rows = read_metrics(run / "metrics.jsonl")
    assert len([r for r in rows if "rollout/logprob_abs_gap" in r]) == 3
