"""`posttrain ppo` with several rewards (`--reward.func_path` with `--reward.func_weights`, beside a reward
model): each term is logged as reward/<name> beside the sum; a weights list that does not fit the files
stops the run at validation."""
import textwrap

import pytest
from rl_runs import ppo_flags

from posttrain.utils.metrics import read_metrics

PARTS = textwrap.dedent("""
    def reward_func(prompts, completions, **kwargs):
        return {"digits": [float(any(ch.isdigit() for ch in c)) for c in completions],
                "short": [float(len(c) <= 3) for c in completions]}
""")


def _flags(rl_setup, out, *extra):
    """`ppo_flags` without its --reward.remote_url."""
    flags = ppo_flags(rl_setup, out, *extra)
    i = flags.index("--reward.remote_url")
    return flags[:i] + flags[i + 2:]


def test_two_functions_with_weights_log_each_term_beside_the_sum(rl_setup, tmp_path):
    from posttrain.cli import train_ppo_ray

    _, _, rewards = rl_setup
    (tmp_path / "parts.py").write_text(PARTS)
    out = tmp_path / "run"
    train_ppo_ray.main(_flags(rl_setup, out, "--reward.func_path", rewards / "correct.py",
                              tmp_path / "parts.py", "--reward.func_weights", "1", "0.5",
                              "--train.max_steps", "1"))
    row = read_metrics(out / "metrics.jsonl")[0]
    assert {"reward/correct", "reward/digits", "reward/short", "reward/correct/accuracy"} <= set(row)
    terms = row["reward/correct"] + 0.5 * (row["reward/digits"] + row["reward/short"])
    assert row["reward/mean"] == pytest.approx(terms, abs=1e-6)
    assert 0 < row["reward/digits"]  # the SFT-ed model answers with numbers


def test_a_reward_model_and_a_rule_train_together(rl_setup, tmp_path, tiny_score_model_dir):
    from posttrain.cli import train_ppo_ray

    _, _, rewards = rl_setup
    out = tmp_path / "run"
    train_ppo_ray.main(_flags(rl_setup, out, "--reward.model_name_or_path", tiny_score_model_dir,
                              "--reward.func_path", rewards / "correct.py", "--reward.model_weight", "2",
                              "--algo.advantage.estimator", "group_norm", "--train.max_steps", "1"))
    row = read_metrics(out / "metrics.jsonl")[0]
    assert row["reward/mean"] == pytest.approx(row["reward/correct"] + 2 * row["reward/model"], abs=1e-5)


def test_a_wrong_number_of_weights_stops_at_validation(rl_setup, tmp_path, capsys):
    from posttrain.cli import train_ppo_ray

    _, _, rewards = rl_setup
    flags = _flags(rl_setup, tmp_path / "run", "--reward.func_path", rewards / "correct.py",
                   rewards / "spread.py", "--reward.func_weights", "1")
    flags[flags.index("--actor.model_name_or_path") + 1] = str(tmp_path / "no-model")  # never reached
    with pytest.raises(SystemExit) as exit_info:
        train_ppo_ray.main(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == ["posttrain ppo: error: --reward.func_weights has 1 weights for 2 "
                                "--reward.func_path files; give one weight per file (or none: 1 each)"]
