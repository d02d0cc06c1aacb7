"""A process reward model in `posttrain ppo` (--reward.prm): each step's score is a token reward on the step's
last token, normalised over a prompt's steps under a group estimator (docs/rewards.md#process-reward-models-
in-rl); its flags' mistakes end in one line and exit status 2."""
import json
import math
import shutil

import pytest
import torch
from rl_runs import ppo_flags

from tests.cli.test_cli_input_errors import in_process, one_error_line, ppo_argv


class FakePRM:
    """`score_steps` of given step ends and scores (the PRM's own output is tested in tests/rewards)."""

    def __init__(self, ends, scores):
        from posttrain.rewards.process_reward_model import StepRewards

        self.result = StepRewards(ends, scores, [len(e) for e in ends], [0] * len(ends))

    def score_steps(self, prompts, responses):
        return self.result


def make(estimator, skipped=(False,) * 4):
    """Two prompts (3 and 2 tokens) x 2 samples (4, 3, 2 and 0 response tokens), no sequence reward, the
    PRM's steps: sample 0 ends steps on response tokens 1 and 3 (scores 0.2, 0.4), sample 1 on 2 (0.9),
    sample 2 on 0 and 1 (0.5, 0.7), the empty sample 3 has none; --reward.model_weight 2."""
    from posttrain.config import parse_config
    from posttrain.rollout.single_turn import Rollout, ScoredRollouts
    from posttrain.trainers.rl.batch_forward import Batching
    from posttrain.trainers.rl.experience_maker import ExperienceMaker

    cfg = parse_config("ppo", [
        "--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl", "--reward.prm",
        "--reward.model_name_or_path", "prm", "--reward.model_weight", "2",
        "--algo.advantage.estimator", estimator, "--rollout.n_samples_per_prompt", "2",
        "--rollout.batch_size", "2", "--train.batch_size", "4", "--algo.kl.init_coef", "0"], device="cpu")
    outs = [[5, 6, 7, 8], [5, 6, 7], [5, 6], []]
    rolls = [Rollout([1, 2, 3] if i < 2 else [1, 2], o, [0.0] * len(o), "stop", "", "", group=i // 2)
             for i, o in enumerate(outs)]
    scored = ScoredRollouts(rolls, torch.zeros(4), torch.zeros(4), {}, torch.tensor(skipped))
    prm = FakePRM([[1, 3], [2], [0, 1], []], [[0.2, 0.4], [0.9], [0.5, 0.7], []])
    return ExperienceMaker(cfg, None, None, None, Batching(4), 0, prm=prm).make(scored, kl_coef=0.0)


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo"])
def test_step_scores_become_normalised_token_rewards_on_each_steps_last_token(estimator):
    """group_norm (group baseline of the zero sequence rewards, gamma 1, no whitening): each advantage is the
    sum of the token rewards at and after it, 2 x (r - mean) / std over a prompt's steps (unbiased std):
    prompt 0's steps 0.2 0.4 0.9 (std sqrt(0.13)), prompt 1's 0.5 0.7 (std sqrt(0.02)). Response token j of
    a sample with a prompt of p tokens is action column p - 1 + j. dr_grpo: 2 x (r - mean), no std."""
    exp, metrics = make(estimator)
    s0, s1 = (math.sqrt(0.13), math.sqrt(0.02)) if estimator == "group_norm" else (1.0, 1.0)
    a, b = 2 * -0.3 / s0, 2 * -0.1 / s0  # sample 0's steps, on columns 3 and 5
    want = torch.zeros(4, 6)
    want[0, 2:6] = torch.tensor([a + b, a + b, b, b])
    want[1, 2:5] = 2 * 0.4 / s0  # one step, on its last token (column 4)
    want[2, 1:3] = torch.tensor([0.0, 2 * 0.1 / s1])  # -0.1 / s1 on column 1, +0.1 / s1 on column 2
    torch.testing.assert_close(exp.advantages, want, atol=1e-5, rtol=0)
    assert metrics["reward/prm"] == pytest.approx(0.54)  # the raw step scores' mean
    assert metrics["reward/prm_steps"] == pytest.approx(5 / 4)
    assert metrics["reward/prm_dropped_steps"] == 0


def test_other_estimators_take_the_raw_scores_and_a_skipped_sample_no_steps():
    """reinforce (no group): the returns are the sums of 2 x the raw scores at and after each token; a skipped
    sample's steps get no reward and leave the statistics."""
    exp, metrics = make("reinforce", skipped=(False, True, False, False))
    want = torch.zeros(4, 6)
    want[0, 2:6] = torch.tensor([1.2, 1.2, 0.8, 0.8])
    want[2, 1:3] = torch.tensor([2.4, 1.4])
    torch.testing.assert_close(exp.returns, want, atol=1e-6, rtol=0)
    assert metrics["reward/prm"] == pytest.approx((0.2 + 0.4 + 0.5 + 0.7) / 4)
    assert metrics["reward/prm_steps"] == pytest.approx(4 / 3)


def test_a_ppo_run_with_a_prm_alone_trains_on_its_token_rewards(rl_setup, tiny_model_dir, tmp_path):
    """One step in one process, the nano LM as the PRM with a prm.json: the sequence rewards are 0, so the
    advantages (dr_grpo: no whitening) come from the step rewards alone."""
    prm = tmp_path / "prm"
    shutil.copytree(tiny_model_dir, prm)
    (prm / "prm.json").write_text(json.dumps({"placeholder_token": "@", "reward_tokens": ["+", "-"],
                                              "step_separator": "\n"}))
    out = tmp_path / "run"
    from posttrain.cli import train_ppo_ray

    train_ppo_ray.main(ppo_flags(rl_setup, out, "--reward.prm", "--reward.model_name_or_path", prm,
                                 "--algo.advantage.estimator", "dr_grpo", "--train.max_steps", "1",
                                 reward=None))
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < row["reward/prm"] < 1 and row["reward/prm_steps"] >= 1
    assert row["reward/mean"] == 0 and abs(row["advantage/mean"]) > 1e-4


@pytest.mark.parametrize("extra, needles", [
    (["--reward.prm", "--reward.func_path", "r.py"], ["--reward.prm", "needs --reward.model_name_or_path"]),
    (["--reward.prm", "--reward.remote_url", "http://localhost:1/r"], ["refused with --reward.remote_url"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL"],
     ["has no prm.json", "--reward.prm_placeholder"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--reward.prm_placeholder_token", "ки"],
     ["placeholder token 'ки' is 2 tokens"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--reward.prm_placeholder_token", "@",
      "--reward.prm_reward_tokens", "+", "ки"], ["reward token 'ки' is 2 tokens"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--reward.prm_reward_tokens", "+"],
     ["--reward.prm_reward_tokens", "at least two distinct tokens"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--reward.prm_reward_tokens", "+", "+"],
     ["--reward.prm_reward_tokens + +", "at least two distinct tokens"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--reward.prm_placeholder_token", "+"],
     ["the placeholder '+' is also a reward token"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--reward.prm_placeholder_token", "How"],
     ["the placeholder token 'How' merges with the text around it"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--reward.normalize_enable"],
     ["--reward.normalize_enable", "probabilities"]),
    (["--reward.prm", "--reward.model_name_or_path", "MODEL", "--algo.dynamic_filtering_enable"],
     ["--algo.dynamic_filtering_enable", "a PRM alone"]),
])
def test_prm_flag_mistakes_end_in_one_line(capfd, tiny_model_dir, tmp_path, extra, needles):
    extra = [tiny_model_dir if e == "MODEL" else e for e in extra]
    one_error_line(in_process(capfd, *ppo_argv(tiny_model_dir, tmp_path, *extra)), *needles)
