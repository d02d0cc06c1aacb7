"""`posttrain ppo --train.agent_func_path`: an agent file written for OpenRLHF trains unchanged, in one
process and on Ray rollout engines."""
from __future__ import annotations

import json

import pytest

from posttrain.utils.metrics import read_metrics

# The shape of OpenRLHF 0.10.2's examples/python/agent_func.py: a random 1-3 step environment that
# imports OpenRLHF's API, keeps state on the instance, returns tensors, echoes the sampling params.
OPENRLHF_STYLE_AGENT = '''
import random
from typing import Any, Dict

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.randint(1, 3)

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        done = self.step_idx >= self.max_steps
        reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0)
        feedback = ("\\n\\nHuman: [CORRECT]\\n</s>" if done
                    else "\\n\\nHuman: [INCORRECT]\\nTry again.\\n</s>\\n\\nAssistant: ")
        self.step_idx += 1
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"dummy_scores": reward},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def agent_flags(rl_setup, out, agent, *extra):
    sft, data, _ = rl_setup
    return ["--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data),
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--data.max_len", "64", "--train.agent_func_path", str(agent), "--rollout.batch_size", "4",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "4",
            "--rollout.micro_batch_size", "8", "--train.batch_size", "8", "--train.micro_batch_size", "8",
            "--data.max_samples", "8", "--algo.advantage.estimator", "reinforce_baseline",
            "--algo.kl.init_coef", "0", "--train.num_episodes", "1", "--actor.adam.lr", "1e-3",
            "--ckpt.output_dir", str(out), *map(str, extra)]


# the Ray engines (vLLM's where it runs) uncompiled, as in the other vLLM tests: vLLM's torch.compile start-up
# costs each engine seconds and is no part of what the agent tests check (README's Ray + vLLM command,
# tests/docs, runs the compiled engines)
EAGER = ("--vllm.enforce_eager",)


@pytest.fixture
def openrlhf_agent(tmp_path):
    """The agent file, with the `openrlhf` stand-ins not yet imported in this process: a test that ran
    earlier in the same pytest worker may have imported them, and the run names a stand-in only the first
    time it is imported."""
    from posttrain.compat import openrlhf_modules

    path = tmp_path / "agent_func.py"
    path.write_text(OPENRLHF_STYLE_AGENT)
    openrlhf_modules.uninstall()
    yield path
    openrlhf_modules.uninstall()


@pytest.mark.slow
def test_openrlhf_agent_file_trains_unchanged(rl_setup, openrlhf_agent, tmp_path, capfd):
    from posttrain.cli import train_ppo_ray

    out = tmp_path / "agent"
    train_ppo_ray.main(agent_flags(rl_setup, out, openrlhf_agent))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 1.0 <= r["agent/turns_mean"] <= r["agent/turns_max"] <= 4.0  # 1-3 failed turns + the done one
        assert r["agent/env_tokens"] > 0 and r["agent/failed"] == 0.0 and r["agent/step_time"] >= 0
        assert "reward/dummy_scores" in r and r["actor/policy_loss"] == r["actor/policy_loss"]
    assert (out / "model.safetensors").exists()
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert "Human:" in sample["response"]  # the environment's feedback is part of the trained sequence
    err = capfd.readouterr().err
    assert "agent: AgentExecutor from" in err and "`openrlhf.utils.agent`" in err


def test_agent_file_errors_stop_before_any_model_loads(rl_setup, tmp_path, capfd):
    from posttrain.cli import train_ppo_ray

    bad = tmp_path / "bad_agent.py"
    bad.write_text("from openrlhf.utils.agent import MultiTurnAgentExecutor\n\nclass Other:\n    pass\n")
    with pytest.raises(SystemExit) as exit_:
        train_ppo_ray.main(agent_flags(rl_setup, tmp_path / "bad", bad))
    assert exit_.value.code == 2
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert (line.startswith("posttrain ppo: error: --train.agent_func_path ")
            and "defines no `AgentExecutor`" in line)


@pytest.mark.e2e
def test_agent_episodes_run_inside_the_ray_rollout_engines(rl_setup, tmp_path, ray_session):
    """As OpenRLHF's: each prompt's episodes run in the actor of the engine it is dispatched to."""
    import os

    from posttrain.cli import train_ppo_ray

    pids = tmp_path / "pids"
    pids.mkdir()
    agent = tmp_path / "agent_func.py"
    agent.write_text(OPENRLHF_STYLE_AGENT.replace("        self.step_idx += 1\n",
                                                  f"        self.step_idx += 1\n"
                                                  f"        open({str(pids)!r} + '/' + "
                                                  f"str(__import__('os').getpid()), 'a').close()\n"))
    out = tmp_path / "agent_ray"
    train_ppo_ray.main(agent_flags(rl_setup, out, agent, "--vllm.num_engines", "2", *EAGER,
                                   "--data.max_samples", "4"))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 1 and rows[0]["agent/turns_mean"] >= 1.0 and rows[0]["agent/failed"] == 0.0
    stepped_in = {int(p.name) for p in pids.iterdir()}
    assert len(stepped_in) == 2 and os.getpid() not in stepped_in  # both engine actors, not the controller


OPENAI_CLIENT_AGENT = """
from posttrain.agents.openai_server import OpenAIServerAgentExecutor


class AgentExecutor(OpenAIServerAgentExecutor):
    async def run_agent(self, prompt, label, session):
        client = session.openai_client()
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model=session.model, messages=messages)
        answer = reply.choices[0].message.content
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "Sure? Answer again."}]
        again = await client.chat.completions.create(model=session.model, messages=messages)
        await client.close()
        final = again.choices[0].message.content.strip()
        return {"reward": 1.0 if final.startswith(str(label)) else 0.0}
"""


@pytest.mark.slow
def test_an_openai_client_agent_trains_through_the_server(rl_setup, tmp_path):
    pytest.importorskip("openai")
    from posttrain.cli import train_ppo_ray

    agent = tmp_path / "openai_agent.py"
    agent.write_text(OPENAI_CLIENT_AGENT)
    out = tmp_path / "openai_agent"
    train_ppo_ray.main(agent_flags(rl_setup, out, agent, "--data.max_len", "96"))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["agent/turns_mean"] == 2.0 and r["agent/env_tokens"] > 0 for r in rows)
    # a re-rendering divergence is counted, never trained
    assert all(r["agent/failed"] <= 0.1 * 8 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["gae", "reinforce", "rloo", "group_norm", "dr_grpo"])
def test_every_estimator_trains_on_multi_turn_samples(estimator, rl_setup, openrlhf_agent, tmp_path):
    """One step each (reinforce_baseline: the tests above); GAE trains a critic on the episode tokens.
    With shaping and dynamic filtering on (they read each episode's length, budget and scores)."""
    from posttrain.cli import train_ppo_ray

    out = tmp_path / estimator
    train_ppo_ray.main(agent_flags(
        rl_setup, out, openrlhf_agent, "--algo.advantage.estimator", estimator, "--data.max_samples", "4",
        "--reward.overlong_buffer_len", "2", "--reward.stop_properly_penalty_coef", "0.5",
        "--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "-0.01", "1.01"))
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert row["agent/turns_mean"] >= 1.0 and row["actor/policy_loss"] == row["actor/policy_loss"]
    assert ("critic/value_loss" in row) == (estimator == "gae")


UNSCORED_AGENT = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        return {"rewards": None, "environment_feedback": " and?", "done": self.turn == 2}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_a_reward_model_scores_episodes_the_environment_leaves_unscored(rl_setup, tiny_score_model_dir,
                                                                        tmp_path):
    from posttrain.cli import train_ppo_ray

    agent = tmp_path / "unscored.py"
    agent.write_text(UNSCORED_AGENT)
    out = tmp_path / "rm"
    train_ppo_ray.main(agent_flags(rl_setup, out, agent, "--reward.model_name_or_path", tiny_score_model_dir,
                                   "--data.max_samples", "4"))
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert row["agent/turns_mean"] == 2.0 and row["reward/std"] > 0  # real RM scores, not a constant
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert sample["response"].count(" and?") == 2


@pytest.mark.e2e
def test_an_openai_client_agent_runs_inside_a_ray_rollout_engine(rl_setup, tmp_path, ray_session):
    pytest.importorskip("openai")
    from posttrain.cli import train_ppo_ray

    agent = tmp_path / "openai_agent.py"
    agent.write_text(OPENAI_CLIENT_AGENT)
    out = tmp_path / "openai_agent_ray"
    train_ppo_ray.main(agent_flags(rl_setup, out, agent, "--data.max_len", "96", "--vllm.num_engines", "1",
                                   *EAGER, "--data.max_samples", "4"))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 1 and rows[0]["agent/turns_mean"] == 2.0 and rows[0]["agent/failed"] <= 0.1 * 8


# examples/scripts/train_reinforce_baseline_ray_agent_async.sh of OpenRLHF 0.10.2: its flags as the script
# has them, with our nano model, data and the agent file above; ranks 4 -> 2, one vLLM engine of tp 1 (their
# 2 x tp 2 over 4 GPUs; a TP-2 engine is tested in test_rl_vllm_tp.py, slow to start here), lengths and batch
# sizes scaled down (8 prompts: two steps, the second one's rollout generated during the first one's
# training). --data.max_len leaves room for the agent's
# turns: at 64 most episodes ran out of tokens before their random 0/1 reward, so most groups scored 0, 0 and
# dynamic filtering (which drops groups whose samples agree) now and then kept none of the 20 it may draw.
REINFORCE_AGENT_ASYNC = """
   --ckpt.load_enable --ckpt.save_hf --ckpt.max_num 3 --ckpt.save_steps 10
   --data.input_key prompt --data.label_key answer --data.max_len 128 --rollout.max_new_tokens 4
   --data.apply_chat_template --ds.packing_samples
   --rollout.batch_size 4 --rollout.n_samples_per_prompt 2 --train.batch_size 8
   --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0.0 1.0
   --train.dynamic_batch_enable --train.max_tokens_per_gpu 256 --rollout.max_tokens_per_gpu 512
   --train.micro_batch_size 1 --rollout.micro_batch_size 8 --data.max_samples 8 --train.max_epochs 1
   --train.num_episodes 1
   --train.async_enable --train.partial_rollout_enable
   --ref.num_nodes 1 --ref.num_gpus_per_node 2 --actor.num_nodes 1 --actor.num_gpus_per_node 2
   --vllm.num_engines 1 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.95 --train.colocate_all
   --ds.enable_sleep --vllm.sync_backend nccl --vllm.enforce_eager
   --ds.zero_stage 3 --actor.gradient_checkpointing_enable --ds.ring_attn_size 2 --ds.ring_attn_head_stride 2
   --ds.param_dtype fp32
   --algo.advantage.estimator reinforce_baseline --actor.adam.lr 5e-7 --actor.entropy_coef 0.0
   --algo.kl.init_coef 1e-5 --algo.kl.use_loss --algo.kl.estimator k2
   --algo.advantage.is_correction_enable --algo.advantage.is_correction_type icepop
   --logger.logging_steps 1 --eval.steps -1
""".split()


@pytest.mark.e2e
def test_openrlhf_async_agent_script_runs_on_ray(rl_setup, openrlhf_agent, tmp_path, ray_address):
    """Async, partial rollout, an OpenRLHF agent file, ZeRO-3 over 2 actor ranks, colocate_all: through
    `python -m posttrain.cli.train_ppo_ray` as the script launches it, joining the running Ray instance
    (RAY_ADDRESS) as the script does, on a real vLLM engine (AsyncLLM) where this machine runs vLLM."""
    import os
    import subprocess
    import sys

    from posttrain.config.backends import vllm_unavailable

    sft, data, _ = rl_setup
    out = tmp_path / "agent_async"
    r = subprocess.run([sys.executable, "-m", "posttrain.cli.train_ppo_ray", *REINFORCE_AGENT_ASYNC,
                        "--actor.model_name_or_path", sft, "--data.prompt_dataset", data,
                        "--train.agent_func_path", openrlhf_agent, "--ckpt.output_dir", out,
                        # 10 > this run's 2 steps
                        "--ckpt.path", tmp_path / "ckpt", "--ckpt.save_steps", "2"],
                       check=False, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_ADDRESS": ray_address})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "async RL: rollouts generated up to 1 step(s) ahead of training, partial rollout" in r.stderr
    assert ("1 rollout engine(s): vllm" if vllm_unavailable() is None
            else "1 rollout engine(s): hf") in r.stderr
    rows = [x for x in read_metrics(out / "metrics.jsonl") if "reward/mean" in x]
    assert len(rows) == 2
    for x in rows:
        assert x["agent/turns_mean"] >= 1.0 and x["rollout/policy_versions_per_sample"] >= 1.0
        assert 0 <= x["async/staleness_max"] <= 1 and "actor/kl_loss" in x  # never more than the queue
    assert (out / "model.safetensors").exists()
    assert (tmp_path / "ckpt" / "global_step2_hf" / "model.safetensors").exists()


# One-turn episodes whose reward is the label divided by 10: the reward of a prompt depends on the
# agent only, not on what the model samples (no reward source is given).
LABEL_AGENT = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        reward = float(states["label"]) / 10
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                "sampling_params": states.get("sampling_params")}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.mark.slow
def test_eval_set_is_scored_by_the_agent(rl_setup, tmp_path):
    """`--eval.dataset` with `--train.agent_func_path`: the evaluation episodes run through the agent,
    so pass1 is the mean of label / 10 over the eval prompts, and pass2 (the best of 2 samples) too."""
    from posttrain.cli import train_ppo_ray
    from posttrain.data.synthetic import write_jsonl

    agent = tmp_path / "label_agent.py"
    agent.write_text(LABEL_AGENT)
    labels = ["2", "4", "9", "1"]
    write_jsonl([{"prompt": f"{a}+0=", "answer": a} for a in labels], tmp_path / "evalset" / "test.jsonl")
    out = tmp_path / "run"
    final = train_ppo_ray.main(agent_flags(rl_setup, out, agent, "--eval.dataset", tmp_path / "evalset",
                                           "--eval.split", "test", "--eval.steps", "2",
                                           "--eval.n_samples_per_prompt", "2", "--eval.temperature", "1.0"))
    expected = sum(float(a) / 10 for a in labels) / len(labels)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "eval_evalset_pass1" in r]
    assert [r["step"] for r in rows] == [0, 2]  # the starting model (the best model's baseline), step 2
    assert all(r["eval_evalset_pass1"] == pytest.approx(expected) for r in rows)
    assert all(r["eval_evalset_pass2"] == pytest.approx(expected) for r in rows)
    assert final["eval_evalset_pass1"] == pytest.approx(expected)
    train = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]  # training ran on the agent's rewards too
