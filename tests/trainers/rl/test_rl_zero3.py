"""The PPO roles under ZeRO-3 on 2 ranks (one torchrun launch of `zero3_roles_worker.py`, gloo on CPU):
each rank loads only its shard of every model (a LoRA actor, the reference, the reward model), and
what the sharded roles compute equals the same roles built whole in this process — the reference's
log-probs and the reward model's scores with ranks that run different numbers of forwards (one rank
with nothing to score), the LoRA actor's weights (base and freshly initialised adapters) and log-probs;
and log-probs in row chunks on one rank and whole on the other equal the whole computation.
The whole PPO run on Ray under
ZeRO-3 is `test_rl_ray.py::test_openrlhf_ppo_hybrid_script_equals_one_process_and_resumes`."""
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from zero3_roles_worker import BATCHES, LORA, PRM_ROWS, ROWS, config, experience, prm_ids

from posttrain.models import load_tokenizer
from posttrain.rewards.reward_model import RewardModelSource
from posttrain.trainers.rl import build

pytestmark = pytest.mark.e2e
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def sharded(tiny_model_dir, tiny_score_model_dir, tmp_path_factory):
    """[rank 0's results, rank 1's] of the worker (its docstring)."""
    tmp = tmp_path_factory.mktemp("zero3_roles")
    out, value_head = tmp / "out.pt", tmp / "rm-value-head"
    shutil.copytree(tiny_score_model_dir, value_head)
    weights = load_file(value_head / "model.safetensors")
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, value_head / "model.safetensors", metadata={"format": "pt"})
    with socket.socket() as sock:  # torchrun's --master_port 0 does not reach the workers' rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           os.path.join(HERE, "zero3_roles_worker.py"), str(out), tiny_model_dir, tiny_score_model_dir,
           str(value_head)]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


def _each_rank_holds_a_shard(sizes):
    """Every rank held under 60% of the model once loaded, and together all of it."""
    own = [o for o, _ in sizes]
    full = sizes[0][1]
    assert all(o < 0.6 * full for o in own) and sum(own) >= full, sizes


def test_lora_actor_loads_sharded_and_equals_the_whole_actor(sharded, tiny_model_dir, tiny_score_model_dir):
    """peft adds the adapters (whole, initialised from the role's seed) to a base loaded as shards, and
    DeepSpeed partitions them at initialisation: the gathered weights equal the whole actor's exactly."""
    _each_rank_holds_a_shard([r["actor_lora"]["held"] for r in sharded])
    tok = load_tokenizer(tiny_model_dir)
    whole = build.build_actor(config(tiny_model_dir, tiny_score_model_dir, *LORA), tok, torch.device("cpu"),
                              4)
    assert sharded[0]["actor_lora"]["peft"] and whole.peft
    assert sharded[0]["actor_lora"]["tied"] == []  # partitioned weights share one empty `data`: not tied
    state = whole.model.state_dict()
    gathered = sharded[0]["actor_lora"]["weights"]
    assert sorted(gathered) == sorted(state) and any("lora_A" in k for k in state)
    assert max(float((gathered[k] - state[k]).abs().max()) for k in state) == 0
    for rank in (0, 1):
        expected = whole.logprobs(experience(ROWS["actor"][rank], tok.pad_token_id), BATCHES)
        assert torch.allclose(sharded[rank]["actor_lora"]["logprobs"], expected, atol=1e-6, rtol=0)


def test_reference_is_held_as_shards_and_equals_the_whole_model(sharded, tiny_model_dir,
                                                                tiny_score_model_dir):
    assert [r["ref"]["engine"] for r in sharded] == ["FrozenShards", "FrozenShards"]
    _each_rank_holds_a_shard([r["ref"]["held"] for r in sharded])
    tok = load_tokenizer(tiny_model_dir)
    whole = build.build_reference(config(tiny_model_dir, tiny_score_model_dir), tok, torch.device("cpu"))
    for rank in (0, 1):  # rank 0: three micro-batches, rank 1: one (padded to three)
        expected = whole.logprobs(experience(ROWS["ref"][rank], tok.pad_token_id), BATCHES)
        assert torch.allclose(sharded[rank]["ref"]["logprobs"], expected, atol=1e-6, rtol=0)


def test_sharded_reward_model_pads_its_batches_and_scores_as_the_whole_one(sharded, tiny_model_dir,
                                                                           tiny_score_model_dir):
    """Ranks scoring different numbers of batches (one of them none) all finish, with the whole model's
    scores."""
    assert all(r["reward"]["sharded"] for r in sharded)
    _each_rank_holds_a_shard([r["reward"]["held"] for r in sharded])
    whole = RewardModelSource(tiny_score_model_dir, batch_size=2, tokenizer=load_tokenizer(tiny_model_dir))
    assert whole.engine is None and whole.loaded_numel[0] == whole.loaded_numel[1]
    for rank in (0, 1):
        for rows, got in zip(ROWS["reward"][rank], sharded[rank]["reward"]["scores"]):
            assert len(got) == len(rows)
            if rows:
                assert torch.allclose(got, whole.score_tokens(rows).rewards, atol=1e-6, rtol=0)


def test_a_sharded_prm_pads_its_batches_and_scores_steps_as_the_whole_one(sharded, tiny_model_dir):
    """A process reward model as ZeRO-3 shards (--reward.prm under --ds.zero_stage 3): ranks forwarding
    different numbers of batches (one of them none) all finish, with the whole model's step ends and
    scores."""
    from posttrain.models.prm_spec import PRMSpec
    from posttrain.rewards.process_reward_model import ProcessRewardSource

    tok = load_tokenizer(tiny_model_dir)
    whole = ProcessRewardSource(tiny_model_dir, PRMSpec("@"), tok, batch_size=2)
    for rank in (0, 1):
        assert sharded[rank]["prm"]["sharded"]
        for rows, got in zip(PRM_ROWS[rank], sharded[rank]["prm"]["steps"]):
            want = whole.score_steps(*prm_ids(tok, rows))
            assert got["ends"] == want.ends and got["steps"] == want.steps
            flat = [s for row in got["scores"] for s in row]
            assert flat == pytest.approx([s for row in want.scores for s in row], abs=1e-6)
    assert sum(len(row) for row in sharded[1]["prm"]["steps"][1]["scores"]) == 2 + 1 + 3


def test_a_head_stored_under_another_prefix_is_copied_into_the_sharded_head(sharded, tiny_model_dir,
                                                                           tiny_score_model_dir):
    """--ds.value_head_prefix value_head under ZeRO-3: the head is gathered, written from rank 0's copy of the
    checkpoint tensor and partitioned again, so the scores are the whole model's."""
    whole = RewardModelSource(tiny_score_model_dir, batch_size=2, tokenizer=load_tokenizer(tiny_model_dir))
    for rank in (0, 1):
        rows = ROWS["reward"][rank][1]
        assert sharded[rank]["reward_value_head"]["sharded"]
        assert torch.allclose(sharded[rank]["reward_value_head"]["scores"], whole.score_tokens(rows).rewards,
                              atol=1e-6, rtol=0)


def test_log_probs_in_row_chunks_under_zero3_equal_the_whole_logits(sharded):
    """Rank 0's micro-batches exceed the logits budget and go down the chunked path while rank 1's stay
    whole: the head's gathers stay collective-matched (no hang), and the log-probs and the full gradients
    equal the run with every micro-batch whole."""
    for rank in (0, 1):
        runs = sharded[rank]["actor_chunks"]
        assert runs["whole"]["chunked_forwards"] == 1  # the first call's check, on every rank
        assert runs["chunked"]["chunked_forwards"] == (3 if rank == 0 else 1)
        for got, want in zip(runs["chunked"]["logprobs"], runs["whole"]["logprobs"], strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0), rank
    got, want = sharded[0]["actor_chunks"]["chunked"]["grads"], sharded[0]["actor_chunks"]["whole"]["grads"]
    assert got.keys() == want.keys() and all(g is not None for g in want.values())
    for name, g in want.items():
        assert torch.allclose(got[name], g, atol=1e-5, rtol=1e-5), (name, float((got[name] - g).abs().max()))
