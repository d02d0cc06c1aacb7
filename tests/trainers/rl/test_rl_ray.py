"""RL on Ray (`distributed/ray_placement.py`): the same scenarios as in one process, placed as Ray
actor groups of CPU ranks (gloo), compared with the in-process run."""
import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed


def _weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_two_actor_ranks_two_engines_equal_one_process(run_ppo, ray_session):
    common = ("--train.num_episodes", "1", "--data.max_samples", "24", "--train.batch_size", "16",
              "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8")
    local, _ = run_ppo(*common, name="local")
    ray_run, _ = run_ppo(*common, "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2",
                         "--ds.zero_stage", "2", name="ray")
    assert _max_diff(_weights(local), _weights(ray_run)) < 1e-5
