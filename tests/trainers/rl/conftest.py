"""RL test fixtures: the SFT-ed nano model and its data (`sft_nano`, tests/trainers/conftest.py),
reward-function files, and a runner for the real `posttrain ppo` entry."""
import pytest
from rl_runs import REWARD_FUNCS, ppo_flags


@pytest.fixture(scope="session")
def rl_setup(tmp_path_factory, sft_nano):
    """(sft_model_dir, data_dir, reward_dir)."""
    sft, data = sft_nano
    rewards = tmp_path_factory.mktemp("rewards")
    for name, text in REWARD_FUNCS.items():
        (rewards / name).write_text(text)
    return sft, data, rewards


@pytest.fixture
def run_ppo(rl_setup, tmp_path):
    def run(*extra, name="ppo", reward="starts_with_1.py"):
        from posttrain.cli import train_ppo_ray

        out = tmp_path / name
        result = train_ppo_ray.main(ppo_flags(rl_setup, out, *extra, reward=reward))
        return out, result
    return run


@pytest.fixture(scope="module")
def normalised_rm(tiny_score_model_dir, tmp_path_factory):
    """The tiny reward model with the reward mean/std `posttrain rm` stores (--reward.normalize_enable)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("rm_norm") / "rm"
    shutil.copytree(tiny_score_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mean": 0.05, "std": 0.5}))
    return str(path)
