"""`posttrain ppo --train.tool_path`: a file of tool functions trains as multi-turn episodes scored by the
run's reward source, in one process and inside Ray rollout engines."""
from __future__ import annotations

import json

import pytest

from posttrain.agents.examples import CALCULATOR_TOOLS
from posttrain.utils.metrics import read_metrics

# records what the reward source is given, and pays a response that starts with a digit
RECORDING_REWARD = '''
import json, os, torch

def reward_func(queries, prompts, labels, **kwargs):
    with open(os.environ["TOOL_REWARD_LOG"], "a") as f:
        for q, p in zip(queries, prompts):
            f.write(json.dumps({"query": q, "prompt": p}) + "\\n")
    return torch.tensor([float(q[len(p):][:1].isdigit()) for q, p in zip(queries, prompts)])
'''


def tool_flags(rl_setup, out, reward, *extra):
    sft, data, _ = rl_setup
    return ["--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data),
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--data.max_len", "448", "--train.tool_path", CALCULATOR_TOOLS,
            "--reward.remote_url", str(reward), "--rollout.batch_size", "4",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "6",
            "--rollout.micro_batch_size", "8", "--train.batch_size", "8", "--train.micro_batch_size", "8",
            "--data.max_samples", "8", "--algo.advantage.estimator", "reinforce_baseline",
            "--algo.kl.init_coef", "0", "--train.num_episodes", "1", "--actor.adam.lr", "1e-3",
            "--ckpt.output_dir", str(out), *map(str, extra)]


@pytest.fixture
def recording_reward(tmp_path, monkeypatch):
    path, log = tmp_path / "reward.py", tmp_path / "queries.jsonl"
    path.write_text(RECORDING_REWARD)
    monkeypatch.setenv("TOOL_REWARD_LOG", str(log))
    return path, log


@pytest.mark.slow
def test_calculator_tool_file_trains_in_one_process(rl_setup, recording_reward, tmp_path, capfd):
    from posttrain.cli import train_ppo_ray

    reward, log = recording_reward
    out = tmp_path / "tools"
    train_ppo_ray.main(tool_flags(rl_setup, out, reward))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["agent/turns_mean"] >= 1.0 and r["agent/failed"] == 0.0
        assert r["reward/tool_calls"] >= 0.0 and r["reward/tool_errors"] >= 0.0
    sample = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert '"name": "multiply"' in sample["prompt"] and "<tools>" in sample["prompt"]  # rendered with tools
    # the reward source saw each prompt followed by the model's last turn only
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 16 and all(s["query"].startswith(s["prompt"]) for s in seen)
    assert not any("<tool_response>" in s["query"][len(s["prompt"]):] for s in seen)
    assert "tools: multiply from " in capfd.readouterr().err


def test_tool_file_errors_stop_before_any_model_loads(rl_setup, recording_reward, tmp_path, capfd):
    from posttrain.cli import train_ppo_ray

    bad = tmp_path / "bad_tools.py"
    bad.write_text("def lookup(key):\n    '''Look up.\n\n    Args:\n        key: the key\n    '''\n")
    flags = tool_flags(rl_setup, tmp_path / "bad", recording_reward[0])
    flags[flags.index(CALCULATOR_TOOLS)] = str(bad)
    with pytest.raises(SystemExit) as exit_:
        train_ppo_ray.main(flags)
    assert exit_.value.code == 2
    err = capfd.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line == (f"posttrain ppo: error: --train.tool_path {bad}: tool 'lookup': Argument key is missing "
                    f"a type hint in function lookup; give every argument a type hint and the docstring an "
                    f"Args: entry for it")
    assert "parameters" not in err  # no model was loaded


@pytest.mark.e2e
def test_tool_episodes_run_inside_a_ray_rollout_engine(rl_setup, recording_reward, tmp_path, ray_session):
    """The episodes run on the Ray engine actor's vLLM engine (its CPU build here, eager)."""
    from posttrain.cli import train_ppo_ray

    out = tmp_path / "tools_ray"
    train_ppo_ray.main(tool_flags(rl_setup, out, recording_reward[0], "--vllm.num_engines", "1",
                                  "--vllm.enforce_eager", "--data.max_samples", "4"))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 1 and rows[0]["agent/turns_mean"] >= 1.0 and rows[0]["agent/failed"] == 0.0
    assert "reward/tool_calls" in rows[0]
