"""RL on Ray (`trainers/rl/placement/ray_placement.py`): the same scenarios as in one process, placed as Ray
actor groups of CPU ranks (gloo), compared with the in-process run; OpenRLHF's hybrid-engine
scripts with ranks scaled to 2; colocation, two simulated nodes, a killed engine, resume. These test the
placement and the HF engine's samples (equal to the in-process run's), so their engines run the HF engine
(`HF`); the vLLM engines on Ray are tested in test_rl_ray_vllm.py."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from rl_helpers import rewards_by_step
from rl_runs import ppo_flags
from rounding import ADAM_EPS, NORM_REL, adam_weight_tolerance, assert_weights_within
from safetensors.torch import load_file

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e
HF = ("--rollout.engine", "hf")  # Ray engines running the HF engine, as in one process


def _weights(run_dir):
    return load_file(str(run_dir / "model.safetensors"))


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def actor_rounding(rows, lr: float = 2e-3, optimizer_steps_per_row: int = 2) -> float:
    """The most rounding moves an actor's weights, as Adam at `lr` (the conftest's actor lr by default) and
    ADAM_EPS passes it on (rounding.py); `rows`: the metrics rows with `actor/grad_norm` (the mean of the
    row's `optimizer_steps_per_row` steps)."""
    return adam_weight_tolerance(lr, [r["actor/grad_norm"] for r in rows if "actor/grad_norm" in r
                                      for _ in range(optimizer_steps_per_row)])


def assert_same_actor_weights(a, b, rows, lr: float = 2e-3, file: str = "model.safetensors") -> None:
    """The exported actors (`file`) of runs `a` and `b` are equal up to `actor_rounding(rows, lr)`."""
    assert_weights_within(load_file(str(a / file)), load_file(str(b / file)), actor_rounding(rows, lr))


def _without_reward_url(flags: list[str]) -> list[str]:
    i = flags.index("--reward.remote_url")
    return flags[:i] + flags[i + 2:]


def _ppo(flags):
    from posttrain.cli import train_ppo_ray

    return train_ppo_ray.main([str(f) for f in flags])


def test_two_actor_ranks_two_engines_equal_one_process(run_ppo, ray_session):
    """GRPO-style (group baseline, no critic): 2 actor ranks (ZeRO-2) and 2 rollout engines give the
    in-process run's samples and, after 3 steps of 2 optimizer steps each, its weights. The missing-EOS
    penalty reads the EOS ids of the engines in their Ray workers: the same rewards as in one process."""
    common = ("--train.num_episodes", "1", "--data.max_samples", "24", "--train.batch_size", "16",
              "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8",
              "--algo.advantage.estimator", "group_norm", "--reward.missing_eos_penalty", "0.5",
              "--actor.adam.eps", ADAM_EPS)
    local, _ = run_ppo(*common, name="local")
    ray_run, _ = run_ppo(*common, "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2",
                         "--ds.zero_stage", "2", *HF, name="ray")
    assert rewards_by_step(ray_run) == pytest.approx(rewards_by_step(local), abs=1e-6)  # same samples
    # float rounding only: the gradients are summed in another order (two ranks' all-reduce)
    assert_same_actor_weights(local, ray_run, read_metrics(local / "metrics.jsonl"))
    rows = read_metrics(ray_run / "metrics.jsonl")
    assert all(r["timing/weight_sync"] > 0 for r in rows if "timing/weight_sync" in r)
    weights = sum(t.numel() * t.element_size() for t in _weights(ray_run).values())
    synced = {r["sync/bytes"] for r in rows if "sync/bytes" in r}  # every weight (and a tied copy), each sync
    assert len(synced) == 1 and synced.pop() >= weights
    assert any(r["shaping/penalised_frac"] > 0 for r in rows if "shaping/penalised_frac" in r)


@pytest.mark.parametrize("stage", [2])  # ZeRO-0 passed too (run by hand); SFT's tests cover stages 0-2
def test_tensor_parallel_actor_and_critic_equal_one_process(run_ppo, ray_session, capfd, stage):
    """PPO with GAE: the actor and the critic each split over 2 ranks (--ds.tensor_parallel_size 2, AutoTP),
    both ranks of a role taking the same rows; the engines receive whole weights. Rewards, losses and the
    exported (whole) weights equal the in-process run's."""
    common = ("--train.num_episodes", "1", "--data.max_samples", "16", "--train.batch_size", "16",
              "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8",
              "--algo.advantage.estimator", "gae", "--critic.adam.lr", "1e-3", "--actor.adam.eps", ADAM_EPS,
              "--critic.adam.eps", ADAM_EPS)
    local, _ = run_ppo(*common, name="local")
    capfd.readouterr()
    tp, _ = run_ppo(*common, "--actor.num_gpus_per_node", "2", "--critic.num_gpus_per_node", "2",
                    "--vllm.num_engines", "1", "--ds.zero_stage", stage, "--ds.tensor_parallel_size", "2",
                    *HF, name="tp")
    err = capfd.readouterr().err
    for role in ("actor", "critic"):
        assert (f"ray placement: {role} ranks: rank 0 (dp 0, cp 0, tp 0), rank 1 (dp 0, cp 0, tp 1)"
                in err), role
    assert rewards_by_step(tp) == pytest.approx(rewards_by_step(local), abs=1e-6)
    rows = [[r for r in read_metrics(d / "metrics.jsonl") if "actor/policy_loss" in r] for d in (local, tp)]
    for key in ("actor/policy_loss", "critic/value_loss", "actor/grad_norm", "critic/grad_norm"):
        assert [r[key] for r in rows[1]] == pytest.approx([r[key] for r in rows[0]], rel=1e-4, abs=1e-6), key
    assert_same_actor_weights(local, tp, rows[0])


ELASTIC_LAYOUTS = {"one": (), "zero2": ("--actor.num_gpus_per_node", "2", "--critic.num_gpus_per_node", "2",
                                        "--vllm.num_engines", "1", "--ds.zero_stage", "2", *HF),
                   "zero3": ("--actor.num_gpus_per_node", "2", "--critic.num_gpus_per_node", "2",
                             "--vllm.num_engines", "1", "--ds.zero_stage", "3", *HF)}
ELASTIC_COMMON = ("--train.num_episodes", "1", "--data.max_samples", "32", "--train.batch_size", "16",
                  "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8",
                  "--algo.advantage.estimator", "gae", "--critic.adam.lr", "1e-3", "--ckpt.save_steps", "1",
                  "--ckpt.max_num", "4", "--actor.adam.eps", str(ADAM_EPS),
                  "--critic.adam.eps", str(ADAM_EPS))
# each resumes the checkpoint the run before it wrote, one step later: step 1 of the uninterrupted run (one
# process), step 2 of the run resumed on ZeRO-2, step 3 of the one resumed on ZeRO-3
ELASTIC_CHAIN = [("one", "zero2"), ("zero2", "zero3"), ("zero3", "one")]


@pytest.fixture(scope="module")
def elastic_run(rl_setup, tmp_path_factory):
    """`get(i)` -> (run dir, checkpoint dir) of the run resumed on ELASTIC_CHAIN[i]'s layout from step i + 1
    of the run before it in the chain (`get(None)`: the uninterrupted run in one process, 4 steps, a
    checkpoint after each), each run once for the module: two Ray runs serve the three cases."""
    from posttrain.cli import train_ppo_ray

    runs = {}

    def get(i):
        if i not in runs:
            tmp = tmp_path_factory.mktemp(f"elastic_{i}")
            flags = [*ELASTIC_COMMON, "--ckpt.path", tmp / "ck"]
            if i is not None:
                _, before = get(i - 1 if i else None)
                step = f"global_step{i + 1}"
                shutil.copytree(before / step, tmp / "ck" / step)
                flags += [*ELASTIC_LAYOUTS[ELASTIC_CHAIN[i][1]], "--ckpt.load_enable"]
            train_ppo_ray.main(ppo_flags(rl_setup, tmp / "run", *flags))
            runs[i] = (tmp / "run", tmp / "ck")
        return runs[i]
    return get


@pytest.mark.parametrize("before,after", ELASTIC_CHAIN)
def test_a_ppo_checkpoint_resumes_on_another_layout(elastic_run, ray_session, before, after):
    """Elastic resume of the actor and the critic (GAE): a checkpoint written in one process resumes on Ray
    with 2 ranks each under ZeRO-2, one of those ranks' ZeRO-2 resumes under ZeRO-3 on the same ranks, and
    one of 2 ranks under ZeRO-3 in one process; the resumed steps equal the uninterrupted run's (one
    process; rewards 1e-6, weights to rounding, as the layouts equal each other in the tests above)."""
    i = ELASTIC_CHAIN.index((before, after))
    straight, _ = elastic_run(None)
    resumed, _ = elastic_run(i)
    assert len(rewards_by_step(straight)) == 4
    assert len(rewards_by_step(resumed, start=i + 2)) == 3 - i  # the steps after the checkpoint
    assert (rewards_by_step(resumed, start=i + 2)
            == pytest.approx(rewards_by_step(straight, start=i + 2), abs=1e-6))
    assert_same_actor_weights(straight, resumed, read_metrics(straight / "metrics.jsonl"))


def test_every_ppo_role_can_be_a_mixture_of_experts(rl_setup, tiny_moe_dir, tmp_path):
    """PPO with GAE and a KL term, in one process, where the actor, the reference, the critic and the reward
    model are all tiny Qwen3-MoE models: it trains, and --actor.aux_loss_coef adds the actor's and the
    critic's router losses (both logged)."""
    from posttrain.models import build_tiny

    reward_model = tmp_path / "moe_rm"
    build_tiny(reward_model, arch="qwen3_moe", size="nano", head="score", seed=1, verbose=False)
    out = tmp_path / "run"
    _ppo(_without_reward_url(ppo_flags(rl_setup, out)) + [
        "--actor.model_name_or_path", tiny_moe_dir, "--reward.model_name_or_path", reward_model,
        "--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0.01", "--actor.aux_loss_coef", "0.1",
        "--data.max_samples", "8", "--train.num_episodes", "1", "--ds.experts_implementation", "eager"])
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "actor/policy_loss" in r]
    assert rows and all(1.0 <= r["actor/aux_loss"] <= 4.0 and 1.0 <= r["critic/aux_loss"] <= 4.0
                        for r in rows)
    # the MoE reference scored
    assert all(r["kl/coef"] == pytest.approx(0.01) and "kl/mean" in r for r in rows)


def test_moe_actor_on_two_zero3_ranks_equals_one_process_and_takes_the_router_loss(run_ppo, tiny_moe_dir,
                                                                                   ray_session, capfd):
    """GRPO with a tiny Qwen3-MoE actor: 2 actor ranks under ZeRO-3 (expert blocks gathered whole) and 2
    rollout engines give the in-process run's rewards and weights. With --actor.aux_loss_coef the router loss
    is logged and moves the weights. (The router loss is a mean per micro-batch, and the ranks' micro-batches
    hold other rows than one process's, so with it the two placements differ by design.)"""
    common = ("--actor.model_name_or_path", tiny_moe_dir, "--train.num_episodes", "1", "--data.max_samples",
              "16", "--train.batch_size", "16", "--train.micro_batch_size", "4", "--rollout.micro_batch_size",
              "8", "--algo.advantage.estimator", "group_norm", "--actor.adam.eps", ADAM_EPS)
    ray_flags = ("--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2", "--ds.zero_stage", "3", *HF)
    local, _ = run_ppo(*common, name="local", reward="spread.py")  # the tiny MoE never starts with 1
    capfd.readouterr()
    ray_run, _ = run_ppo(*common, *ray_flags, name="ray", reward="spread.py")
    assert ("ZeRO-3 leaf modules (gathered whole, as routing varies): Qwen3MoeSparseMoeBlock"
            in capfd.readouterr().err)
    assert rewards_by_step(ray_run) == pytest.approx(rewards_by_step(local), abs=1e-6)
    rows = read_metrics(local / "metrics.jsonl")
    assert all(r["actor/grad_norm"] > 0 for r in rows if "actor/grad_norm" in r)  # the policy loss acts
    rounding = actor_rounding(rows)
    assert_weights_within(_weights(local), _weights(ray_run), rounding)
    aux, _ = run_ppo(*common, *ray_flags, "--actor.aux_loss_coef", "0.5", name="aux", reward="spread.py")
    rows = [r for r in read_metrics(aux / "metrics.jsonl") if "actor/policy_loss" in r]
    assert len(rows) == 2 and all(1.0 <= r["actor/aux_loss"] <= 4.0 for r in rows)
    assert rewards_by_step(aux)[0] == pytest.approx(rewards_by_step(local)[0], abs=1e-6)  # same first rollout
    assert _max_diff(_weights(aux), _weights(ray_run)) > rounding  # moved by more than rounding can


# examples/scripts/train_ppo_ray_hybrid_engine.sh of OpenRLHF 0.10.2: every rank count 8 -> 2,
# model, reward model, data and sizes ours, bf16 -> fp32 (CPU).
PPO_HYBRID = """
   --ref.num_nodes 1 --ref.num_gpus_per_node 2 --reward.num_nodes 1 --reward.num_gpus_per_node 2
   --critic.num_nodes 1 --critic.num_gpus_per_node 2 --actor.num_nodes 1 --actor.num_gpus_per_node 2
   --vllm.num_engines 1 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5
   --ckpt.save_hf --train.max_epochs 1 --ds.zero_stage 3 --ds.param_dtype fp32
   --actor.adam.lr 5e-4 --critic.adam.lr 5e-4 --algo.kl.init_coef 0.01 --data.apply_chat_template
   --reward.normalize_enable --actor.gradient_checkpointing_enable --ds.packing_samples
   --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep
   --train.dynamic_batch_enable --train.max_tokens_per_gpu 256 --algo.advantage.is_correction_enable
   --rollout.engine hf
""".split()
ONE_PROCESS = {"--ref.num_gpus_per_node": "1", "--reward.num_gpus_per_node": "1",
               "--critic.num_gpus_per_node": "1", "--actor.num_gpus_per_node": "1", "--vllm.num_engines": "0"}


def _hybrid(rl_setup, rm_dir, out, *extra, one_process=False):
    flags = list(PPO_HYBRID)
    if one_process:
        flags = [ONE_PROCESS.get(prev, f) if prev in ONE_PROCESS else f
                 for prev, f in zip([""] + flags, flags)]
    base = _without_reward_url(ppo_flags(rl_setup, out))
    # the reward model (its Ray group) beside a --reward.func_path function, weights 2 and 1: a composite
    return base + flags + ["--reward.model_name_or_path", rm_dir, "--reward.func_path",
                           rl_setup[2] / "correct.py", "--reward.model_weight", "2",
                           "--data.max_samples", "24",
                           "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "8",
                           "--train.num_episodes", "1", "--actor.adam.eps", str(ADAM_EPS),
                           "--critic.adam.eps", str(ADAM_EPS), *extra]


def loaded_shards(stderr: str) -> dict[str, tuple[int, list[int]]]:
    """role -> (parameters of its whole model, [parameters each rank held once loaded]) from the
    placement's start-up lines ("ray placement: ROLE loaded as ... of N parameters: rank 0 n0 (..), ...")."""
    out = {}
    for role, full, held in re.findall(r"ray placement: (\w+) loaded as [^\n]* of (\d+) parameters: ([^\n]*)",
                                       stderr):
        out[role] = (int(full), [int(n) for _, n in re.findall(r"rank (\d+) (\d+)", held)])
    return out


@pytest.fixture(scope="module")
def hybrid_in_one_process(rl_setup, normalised_rm, tmp_path_factory):
    """The hybrid script's run in one process (--ds.no_shared_prefix), trained once for the module: the
    reference the Ray runs of both hybrid tests equal. `get(capfd)` -> (run dir, what the run wrote to stderr,
    captured by the first caller's `capfd`)."""
    runs = {}

    def get(capfd):
        if not runs:
            out = tmp_path_factory.mktemp("hybrid") / "local"
            capfd.readouterr()
            _ppo(_hybrid(rl_setup, normalised_rm, out, "--ds.no_shared_prefix", one_process=True))
            runs["local"] = out, capfd.readouterr().err
        return runs["local"]
    return get


def test_openrlhf_ppo_hybrid_script_equals_one_process_and_resumes(rl_setup, normalised_rm,
                                                                   hybrid_in_one_process, tmp_path,
                                                                   ray_session, capfd):
    """GAE with critic, reference and reward-model groups of 2 ranks (ZeRO-3), all colocated with one rollout
    engine, the reward model's group summed with a reward function: every role loads straight into
    ZeRO-3 shards (each rank holds about half of every model once loaded; the reference and reward model
    stay sharded, in inference-only DeepSpeed engines), and the run gives the same weights as the
    in-process run after 3 steps; a Ray run resumed from its step-2 checkpoint ends where the
    uninterrupted one does. The Ray run computes each prompt once per group (shared prefix, packed,
    under ZeRO-3); the in-process one per sample (--ds.no_shared_prefix)."""
    tiny_score_model_dir = normalised_rm
    local, err = hybrid_in_one_process(capfd)
    assert loaded_shards(err) == {}  # one process: whole models, nothing reported
    full = tmp_path / "full"
    _ppo(_hybrid(rl_setup, tiny_score_model_dir, full, "--ckpt.save_steps", "2", "--ckpt.path",
                 tmp_path / "ck"))
    shards = loaded_shards(capfd.readouterr().err)
    assert sorted(shards) == ["actor", "critic", "ref", "reward"], shards
    for role, (whole, held) in shards.items():
        assert len(held) == 2 and sum(held) >= whole, (role, whole, held)
        assert all(n < 0.6 * whole for n in held), (role, whole, held)
    assert len(rewards_by_step(full)) == 3
    assert rewards_by_step(full) == pytest.approx(rewards_by_step(local), abs=1e-6)
    for row in read_metrics(full / "metrics.jsonl"):  # the model's group and the function, summed per sample
        if "reward/mean" in row:
            want = row["reward/correct"] + 2 * row["reward/model"]
            assert row["reward/mean"] == pytest.approx(want, abs=1e-5)
            assert row["reward/model"] != 0
    # 3 steps of 2 optimizer steps at lr 5e-4 (the script's); the ranks sum in another order
    assert_same_actor_weights(local, full, read_metrics(local / "metrics.jsonl"), lr=5e-4)
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck" / "global_step2", ck / "global_step2")
    resumed = tmp_path / "resumed"
    _ppo(_hybrid(rl_setup, tiny_score_model_dir, resumed, "--ckpt.save_steps", "2", "--ckpt.path", ck,
                 "--ckpt.load_enable"))
    assert rewards_by_step(resumed, start=3) == pytest.approx(rewards_by_step(full)[2:], abs=1e-6)
    assert _max_diff(_weights(full), _weights(resumed)) < 1e-5
    assert (tmp_path / "ck" / "global_step2_hf" / "model.safetensors").exists()


def test_openrlhf_ppo_hybrid_script_with_ring_attention_equals_one_process(rl_setup, normalised_rm,
                                                                          hybrid_in_one_process, tmp_path,
                                                                          ray_session, capfd):
    """The same script with --ds.ring_attn_size 2 --ds.ring_attn_head_stride 2: every role (actor, critic,
    reference, reward model; ZeRO-3) splits each packed micro-batch over its two ranks, which take the same
    rows; the per-token log-probs, values and rewards are gathered over the pair. Rewards and the trained
    weights equal the in-process run's, and each trained role logs what its ring moved."""
    (local, _), ring = hybrid_in_one_process(capfd), tmp_path / "ring"
    capfd.readouterr()
    _ppo(_hybrid(rl_setup, normalised_rm, ring, "--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride",
                 "2"))
    err = capfd.readouterr().err
    for role in ("actor", "critic", "ref", "reward"):  # each rank's coordinates, printed at start-up
        assert (f"ray placement: {role} ranks: rank 0 (dp 0, cp 0, tp 0), rank 1 (dp 0, cp 1, tp 0)"
                in err), role
    assert len(rewards_by_step(ring)) == 3
    assert rewards_by_step(ring) == pytest.approx(rewards_by_step(local), abs=1e-6)
    # the split attention sums in another order: weights equal up to rounding (rounding.py; 3 steps of 2
    # optimizer steps at lr 5e-4); a gradient off by the group size shows in the losses and norms below
    assert_same_actor_weights(local, ring, read_metrics(local / "metrics.jsonl"), lr=5e-4)
    rows = [r for r in read_metrics(ring / "metrics.jsonl") if "actor/policy_loss" in r]
    for role in ("actor", "critic"):
        assert all(r[f"comm/{role}_cp_bytes"] > 0 and r[f"comm/{role}_cp_seconds"] > 0 for r in rows), role
    ones = [r for r in read_metrics(local / "metrics.jsonl") if "actor/policy_loss" in r]
    # rounding as for a gradient norm (NORM_REL), relative to the size of the terms the loss averages: the
    # policy loss's terms (advantage times ratio, ~1) nearly cancel, so its rounding is not relative to it
    for key in ("actor/policy_loss", "critic/value_loss", "actor/grad_norm"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ones], rel=NORM_REL,
                                                       abs=NORM_REL), key


# examples/scripts/train_reinforce_baseline_hybrid_engine.sh: ranks 4 -> 2, its agent
# (--train.agent_func_path, multi-turn: a later issue) replaced by a reward function.
REINFORCE_HYBRID = """
   --data.input_key prompt --data.label_key answer --data.apply_chat_template --ds.packing_samples
   --rollout.n_samples_per_prompt 4 --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0
   --train.dynamic_batch_enable --train.max_tokens_per_gpu 256 --rollout.max_tokens_per_gpu 512
   --train.micro_batch_size 1 --rollout.micro_batch_size 8 --train.max_epochs 1 --train.num_episodes 1
   --ref.num_nodes 1 --ref.num_gpus_per_node 2 --actor.num_nodes 1 --actor.num_gpus_per_node 2
   --vllm.num_engines 1 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.7 --train.colocate_all
   --ds.enable_sleep --vllm.sync_backend nccl --vllm.enforce_eager --ds.zero_stage 3
   --actor.gradient_checkpointing_enable --ds.ring_attn_size 2 --ds.ring_attn_head_stride 2
   --ds.param_dtype fp32 --algo.advantage.estimator reinforce_baseline --actor.entropy_coef 0.0
   --algo.kl.init_coef 1e-5
   --algo.kl.use_loss --algo.kl.estimator k2 --algo.advantage.is_correction_enable
   --algo.advantage.is_correction_type icepop --logger.logging_steps 1 --eval.steps -1 --rollout.engine hf
""".split()


def test_openrlhf_reinforce_baseline_hybrid_script_runs(rl_setup, tmp_path, ray_address):
    """Through `python -m posttrain.cli.train_ppo_ray`, joining the running Ray instance as the script
    does."""
    sft, data, rewards = rl_setup
    out = tmp_path / "reinforce"
    r = subprocess.run([sys.executable, "-m", "posttrain.cli.train_ppo_ray", *REINFORCE_HYBRID,
                        "--actor.model_name_or_path", sft, "--data.prompt_dataset", data,
                        "--reward.remote_url", rewards / "starts_with_1.py", "--rollout.batch_size", "4",
                        "--train.batch_size", "16", "--data.max_samples", "8", "--rollout.max_new_tokens",
                        "4", "--data.max_len", "48", "--ckpt.output_dir", out],
                       check=False, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_ADDRESS": ray_address})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ray placement: engine: group all" in r.stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2 and all("actor/kl_loss" in x and "timing/weight_sync" in x for x in rows)


@pytest.fixture(scope="module")
def colocated_run(rl_setup, tiny_model_dir, tmp_path_factory, ray_session):
    """(run dir, stderr, flags) of one step with both colocation modes on: the two modes place disjoint role
    pairs (actor + ref, critic + reward) in groups of their own, so one run shows both. The reward group holds
    a process reward model (--reward.prm: the untrained nano LM, weight 2) beside a --reward.func_path
    function. An on-policy distillation teacher (the nano model too) shares the actor's bundles with the
    reference."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("colocated") / "run"
    flags = _without_reward_url(ppo_flags(rl_setup, out)) + [
        "--reward.prm", "--reward.model_name_or_path", tiny_model_dir, "--reward.prm_placeholder_token", "@",
        "--reward.func_path", rl_setup[2] / "correct.py", "--reward.model_weight", "2",
        "--algo.advantage.estimator", "gae", "--algo.kl.init_coef", "0.01", "--vllm.num_engines", "1", *HF,
        "--train.colocate_actor_ref", "--train.colocate_critic_reward", "--data.max_samples", "8",
        "--train.num_episodes", "1", "--teacher.model_name_or_path", tiny_model_dir,
        "--algo.teacher_coef", "0.1"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            _ppo(flags)
    finally:
        sys.stderr.write(err.getvalue())  # the run's messages, for a failure report
    return out, err.getvalue(), flags


@pytest.mark.parametrize("mode", ["colocate_actor_ref", "colocate_critic_reward"])
def test_colocation_modes_share_bundles(mode, colocated_run):
    out, err, _ = colocated_run
    pair = ("actor", "ref") if mode == "colocate_actor_ref" else ("critic", "reward")
    group = mode.removeprefix("colocate_")
    for role in pair:
        assert f"ray placement: {role}: group {group} bundle 0, 0.2 of each" in err
    assert len(rewards_by_step(out)) == 1


def test_a_process_reward_model_group_on_ray_beside_a_reward_function(colocated_run):
    """--reward.func_path beside a PRM placed on Ray: the function runs on the controller and gives each
    sequence its reward, the PRM scores the steps in the reward group (its token rewards: advantages)."""
    out, err, _ = colocated_run
    assert "ray placement: reward: group critic_reward" in err
    row = read_metrics(out / "metrics.jsonl")[0]
    assert row["reward/mean"] == pytest.approx(row["reward/correct"], abs=1e-6)
    assert 0 < row["reward/prm"] < 1 and row["reward/prm_steps"] >= 1


def test_a_teacher_and_a_prm_on_ray_score_as_in_one_process(colocated_run, tmp_path):
    """On-policy distillation on Ray: the teacher's ranks share the actor's bundles with the reference
    (--train.colocate_actor_ref), and its reverse KL to the samples, which the HF engines draw as one process
    does, is the one-process run's; so are the PRM's step scores (in the reward group's worker on Ray, in the
    controller in one process) and the advantages both terms give."""
    out, err, flags = colocated_run
    assert "ray placement: teacher: group actor_ref bundle 0, 0.2 of each" in err
    ray_row = read_metrics(out / "metrics.jsonl")[0]
    i = flags.index("--vllm.num_engines")
    local = tmp_path / "local"
    one_process = [str(f) for f in flags[:i] + flags[i + 2:]]
    one_process[one_process.index(str(out))] = str(local)
    _ppo(one_process)
    row = read_metrics(local / "metrics.jsonl")[0]
    assert ray_row["teacher/reverse_kl"] > 0.1
    assert ray_row["teacher/reverse_kl"] == pytest.approx(row["teacher/reverse_kl"], abs=1e-5)
    assert ray_row["reward/prm"] == pytest.approx(row["reward/prm"], abs=1e-6) and ray_row["reward/prm"] > 0
    assert ray_row["reward/prm_steps"] == row["reward/prm_steps"]
    assert ray_row["advantage/mean"] == pytest.approx(row["advantage/mean"], abs=1e-5)


def test_killed_engine_ends_the_run_with_one_clear_error(rl_setup, tmp_path, ray_session):
    """A rollout engine killed between steps: the next step fails at once, naming it, and everything
    the run placed is removed."""
    import ray

    from posttrain.config import parse_config
    from posttrain.trainers.rl.ppo import RLTrainer
    from posttrain.utils.errors import WorkerFailed

    cfg = parse_config("ppo", [str(f) for f in ppo_flags(rl_setup, tmp_path / "killed")] +
                       ["--vllm.num_engines", "2", "--train.num_episodes", "1", *HF])
    trainer = RLTrainer(cfg)
    handles = trainer.rollout_engine.handles
    try:
        trainer.step()
        ray.kill(handles[1], no_restart=True)
        start = time.perf_counter()
        with pytest.raises(WorkerFailed, match="rollout engine rank 1 died"):
            trainer.step()
        assert time.perf_counter() - start < 60
    finally:
        pgs = list(trainer.placement.pgs.values())
        trainer._release_placement()
    assert trainer.placement is None
    table = ray.util.placement_group_table()
    assert all(table[pg.id.hex()]["state"] == "REMOVED" for pg in pgs)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(handles[0].pid.remote(), timeout=30)


def test_two_simulated_nodes_via_ray_address(rl_setup, tmp_path):
    """A cluster of two raylets (1 + 2 CPUs, so 2 actor ranks + 1 engine must span both), joined
    through RAY_ADDRESS by the command line. First, a run asking for more ranks than the cluster has
    ends within the placement timeout with one line naming the rank that could not start."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=2)

    def run(out, *extra, timeout_s="120"):
        flags = ppo_flags(rl_setup, out, "--actor.num_nodes", "2", "--actor.num_gpus_per_node", "1",
                          "--vllm.num_engines", "1", "--ds.zero_stage", "2", "--data.max_samples", "8",
                          "--train.num_episodes", "1", "--algo.advantage.estimator", "group_norm", *HF,
                          *extra)
        return subprocess.run([sys.executable, "-m", "posttrain.cli.train_ppo_ray", *map(str, flags)],
                              check=False, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "RAY_ADDRESS": cluster.address,
                                   "POSTTRAIN_RAY_PLACE_TIMEOUT": timeout_s})
    try:
        r = run(tmp_path / "too_big", "--vllm.num_engines", "2", timeout_s="5")  # it waits all of it
        assert r.returncode == 2, r.stderr[-3000:]
        errors = [line for line in r.stderr.splitlines() if "posttrain ppo: error:" in line]
        assert len(errors) == 1, errors
        assert "cannot place" in errors[0] or "did not start within 5 s" in errors[0], errors
        assert "Traceback" not in r.stderr
        out = tmp_path / "two_nodes"
        r = run(out)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"joining the Ray cluster at {cluster.address}" in r.stderr
        assert len(rewards_by_step(out)) == 1
        assert torch.isfinite(torch.tensor(read_metrics(out / "metrics.jsonl")[0]["actor/grad_norm"]))
    finally:
        cluster.shutdown()


def test_the_default_run_stays_in_one_process_without_ray(rl_setup, tmp_path):
    """Every count at 1, no engines, no RAY_ADDRESS: the run never imports Ray."""
    flags = [str(f) for f in ppo_flags(rl_setup, tmp_path / "alone", "--data.max_samples", "8",
                                       "--train.num_episodes", "1")]
    code = ("import sys; from posttrain.cli import train_ppo_ray; train_ppo_ray.main(sys.argv[1:]); "
            "assert 'ray' not in sys.modules, 'ray was imported'")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    r = subprocess.run([sys.executable, "-c", code, *flags], check=False, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(rewards_by_step(tmp_path / "alone")) == 1


def test_ctrl_c_tears_down_what_the_run_started(rl_setup, tmp_path):
    """SIGINT during a Ray run: one error line, exit 2, and no worker process left behind (the run
    started its own local Ray and stops it)."""
    import signal

    flags = ppo_flags(rl_setup, tmp_path / "interrupted", "--vllm.num_engines", "1",
                      "--actor.num_gpus_per_node", "2", "--algo.advantage.estimator", "group_norm",
                      "--train.num_episodes", "50", *HF)
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.train_ppo_ray", *map(str, flags)],
                            stderr=subprocess.PIPE, text=True, env=env,
                            # not ignored if ours is
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "weight sync verified" in line:
            break
    time.sleep(3)  # inside the training loop
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    err = "".join(seen) + rest
    assert proc.returncode == 2, err[-3000:]
    assert len([x for x in err.splitlines() if "posttrain ppo: error: interrupted" in x]) == 1, err[-3000:]
    deadline = time.monotonic() + 60  # the workers exit a moment after the driver, later on a busy machine
    while True:
        left = subprocess.run(["pgrep", "-f", "ray::RoleWorker|ray::EngineWorker"], check=False,
                              capture_output=True, text=True).stdout.split()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == [], f"worker processes left: {left}"


LORA_COMMON = ("--train.num_episodes", "1", "--data.max_samples", "24", "--train.batch_size", "16",
               "--train.micro_batch_size", "4", "--rollout.micro_batch_size", "8",
               "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0.05",
               "--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--actor.adam.lr", "5e-3",
               "--actor.adam.eps", ADAM_EPS)


@pytest.fixture(scope="module")
def lora_in_one_process(rl_setup, tmp_path_factory):
    """The LoRA run in one process that both `--vllm.lora_sync` modes equal, trained once for the module."""
    from posttrain.cli import train_ppo_ray

    out = tmp_path_factory.mktemp("lora") / "local"
    train_ppo_ray.main(ppo_flags(rl_setup, out, *LORA_COMMON))
    return out


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_lora_two_actor_ranks_two_engines_equal_one_process(run_ppo, lora_in_one_process, ray_session, mode):
    """LoRA with a KL term on Ray: no reference group (the reference is the actor's base with the adapter
    disabled, on the actor's own ranks), the engines take base + adapter once (hash-checked at start-up)
    then the adapter alone (`sync/bytes`), applied as `--vllm.lora_sync` says, and 2 actor ranks (ZeRO-2)
    give the in-process run's samples and adapter (up to rounding: rounding.py)."""
    local = lora_in_one_process
    ray_run, _ = run_ppo(*LORA_COMMON, "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2",
                         "--ds.zero_stage", "2", "--vllm.lora_sync", mode, *HF, name="ray")
    assert rewards_by_step(ray_run) == pytest.approx(rewards_by_step(local), abs=1e-6)  # same samples
    assert_same_actor_weights(local, ray_run, read_metrics(local / "metrics.jsonl"), lr=5e-3,
                              file="adapter_model.safetensors")
    b = load_file(str(ray_run / "adapter_model.safetensors"))
    rows = read_metrics(ray_run / "metrics.jsonl")
    assert all(r["rollout/logprob_abs_gap"] < 1e-4 for r in rows if "rollout/logprob_abs_gap" in r)
    assert any(r["kl/mean"] > 0 for r in rows if "kl/mean" in r)
    adapter = sum(t.numel() * t.element_size() for t in b.values())  # the adapter file: lora_A/B in fp32
    assert {r["sync/bytes"] for r in rows if "sync/bytes" in r} == {adapter}
