"""--ds.gather_for_generation under DeepSpeed ZeRO-3 (`gather_worker.py` runs DeepSpeed in its own
processes, every parameter partitioned at rest).

- One process: the rollout engine samples from the actor's own module. On, each rollout batch is
  generated inside the actor engine's `gathered_for_generation` (entered once per batch; ZeRO's hooks
  release no gathered weight during it); off, from the sharded module (the hooks fetch and release each
  layer per forward). The rollouts and the trained weights are identical.
- Two ranks (the actor's Ray worker): on, its weights hash, sync layout and bucketed broadcast gather
  the whole model in one `GatheredParameters`; off, one tensor at a time, so that no rank holds more
  than one whole parameter. A rollout engine receives the same bytes either way."""
import os
import socket
import subprocess
import sys

import pytest
import torch

from posttrain.utils.weights_hash import weights_hash

pytestmark = pytest.mark.e2e

HERE = os.path.dirname(os.path.abspath(__file__))
REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kwargs):  # the response length: advantages are not zero
    return {"rewards": torch.tensor([float(len(q) - len(p)) / 10 for q, p in zip(queries, prompts)])}
'''


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return dict(env, DS_BUILD_OPS="0", TOKENIZERS_PARALLELISM="false")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, check=False, env=_env(), capture_output=True, text=True, timeout=600, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def in_process(tiny_model_dir, tmp_path_factory):
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    tmp = tmp_path_factory.mktemp("gather_rl")
    write_jsonl(make_arithmetic_rows(8, seed=5, difficulty=0), str(tmp / "data" / "train.jsonl"))
    (tmp / "reward.py").write_text(REWARD)
    out = tmp / "out.pt"
    _run([sys.executable, "gather_worker.py", "rl", tiny_model_dir, str(tmp / "data"), str(tmp / "reward.py"),
          str(out)])
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gather_sync")
    with socket.socket() as sock:  # torchrun's --master_port 0 does not reach the workers' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
          "gather_worker.py", "sync", tiny_model_dir, str(tmp)])
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_in_process_generation_gathers_once_per_rollout_batch_with_the_same_results(in_process,
                                                                                    tiny_model_dir):
    on, off = in_process["on"], in_process["off"]
    steps = len(on["rollouts"])
    assert steps == 2 and on["entered"] == steps and off["entered"] == 0
    assert on["released"] == 0 < off["released"]  # on: the weights stay whole through every decode step
    assert on["rollouts"] == off["rollouts"]  # token ids and sampling log-probs, exactly
    from safetensors.torch import load_file

    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert any(not torch.equal(on["weights"][k], start[k]) for k in start)  # the steps trained
    assert on["weights"].keys() == off["weights"].keys()
    assert all(torch.equal(on["weights"][k], off["weights"][k]) for k in on["weights"])


def test_weight_sync_gathers_one_tensor_at_a_time_when_off_and_sends_the_same_bytes(two_ranks):
    rank0 = two_ranks[0]
    expected = weights_hash(rank0["on"]["reference"])
    entries, params = len(rank0["on"]["reference"]), rank0["on"]["hash_calls"][0][0]
    assert params < entries  # the tied output embedding is one parameter under two names
    for mode in ("on", "off"):
        res = rank0[mode]
        assert weights_hash(res["reference"]) == expected  # the one-shot gather, in both workers
        assert res["hash"] == expected
        assert res["layout"] == rank0["on"]["layout"] and len(res["layout"]) > 1
        assert res["engine_before"] != expected  # the engine's weights were zeroed: it received them all
        assert res["engine_after"] == res["engine_received"] == expected
    for rank in two_ranks:  # (parameters gathered, parameters whole in the module) per GatheredParameters
        for calls in ("hash_calls", "send_calls"):
            assert rank["on"][calls] == [(params, params)]
            assert rank["off"][calls] == [(1, 1)] * entries
