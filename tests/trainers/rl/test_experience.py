"""Token-in token-out layout (docs/algorithms.md, pipeline step 4): the reward lands on the last generated
token under padding, pad == eos, several eos ids and truncation; sampled tokens are never rewritten."""
import pytest
import torch

from posttrain.algorithms.advantages import compute_advantages
from posttrain.rollout.single_turn import Rollout
from posttrain.trainers.rl.experience import build_experience

EOS, PAD = 2, 2  # pad == eos


def rollout(prompt, output, finish="stop"):
    return Rollout(prompt_ids=prompt, output_ids=output, rollout_logprobs=[-0.5] * len(output),
                   finish_reason=finish, prompt_text="", response_text="")


def test_layout_and_reward_position_with_pad_equal_eos_and_truncation():
    rolls = [
        rollout([5, 6, 7], [8, EOS]),             # stopped on eos (== pad)
        rollout([5], [9, 10, 11, 12], "length"),  # truncated: last token is not eos and stays so
        rollout([5, 6], [3]),                     # a second eos id (3) ended this one
    ]
    exp = build_experience(rolls, torch.tensor([1.0, 2.0, 3.0]), pad_id=PAD)
    assert exp.sequences.tolist() == [[5, 6, 7, 8, EOS], [5, 9, 10, 11, 12], [5, 6, 3, PAD, PAD]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # column t scores token t+1: the actions are exactly the sampled tokens
    assert exp.action_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0]]
    assert exp.rollout_logp[0].tolist() == [0, 0, -0.5, -0.5]
    adv, ret = compute_advantages("reinforce", exp.rewards, exp.action_mask, n=1, whiten=False)
    # gamma 1: every action token's return is the sequence reward (placed on its last action)
    assert ret.tolist() == [[0, 0, 1, 1], [2, 2, 2, 2], [0, 3, 0, 0]]
    from posttrain.algorithms.advantages import token_rewards

    placed = token_rewards(exp.rewards, None, exp.action_mask, 0.0)
    assert placed.tolist() == [[0, 0, 0, 1], [0, 0, 0, 2], [0, 3, 0, 0]]


def test_left_padded_rows_are_never_produced_and_select_trims():
    rolls = [rollout([1, 1, 1, 1], [4]), rollout([1], [4, 4, 4])]
    exp = build_experience(rolls, torch.tensor([0.0, 1.0]), pad_id=0)
    part = exp.select([0])
    assert part.sequences.shape == (1, 5) and part.action_mask.tolist() == [[0, 0, 0, 1]]


def test_logprob_count_mismatch_is_an_error():
    bad = Rollout(prompt_ids=[1], output_ids=[2, 3], rollout_logprobs=[-1.0], finish_reason="stop",
                  prompt_text="", response_text="")
    with pytest.raises(ValueError, match="2 output tokens but 1 log-probs"):
        build_experience([bad], torch.tensor([0.0]), pad_id=0)


@pytest.mark.parametrize("clamp, kl_sum", [(10.0, 10.5), (0.0, 15.5)])
def test_kl_clamp_flag_bounds_the_per_token_kl_in_the_reward(clamp, kl_sum):
    """--algo.kl.clamp: OpenRLHF's +-10 per token by default; 0 leaves it unbounded (TRL)."""
    from posttrain.config import parse_config
    from posttrain.rollout.single_turn import ScoredRollouts
    from posttrain.trainers.rl.batch_forward import Batching
    from posttrain.trainers.rl.experience_maker import ExperienceMaker

    class Policy:  # log-probs [0, -0.5] on the two actions; the reference 15 nats lower on the first
        def __init__(self, first):
            self.first = first

        def logprobs(self, exp, batching):
            out = torch.zeros_like(exp.action_mask)
            out[:, -2], out[:, -1] = self.first, -0.5 if self.first == 0.0 else -1.0
            return out * exp.action_mask

    cfg = parse_config("ppo", ["--actor.model_name_or_path", "m", "--reward.remote_url", "r.py",
                               "--data.prompt_dataset", "d", "--algo.advantage.estimator", "reinforce",
                               "--algo.kl.sequence_level_enable", "--algo.kl.init_coef", "1",
                               "--algo.kl.clamp", str(clamp), "--reward.clip_range", "-100", "100"],
                       check=False)
    rolls = [rollout([5, 6], [7, 8])]
    scored = ScoredRollouts(rolls, torch.tensor([0.0]), torch.tensor([0.0]), {}, torch.tensor([False]))
    maker = ExperienceMaker(cfg, Policy(0.0), Policy(-15.0), None, Batching(4), pad_id=0)
    exp, _ = maker.make(scored, kl_coef=1.0)
    # k1 per token: 0 - (-15) = 15 (clamped to 10 or not) and -0.5 - (-1) = 0.5
    assert exp.returns[0, -1].item() == pytest.approx(-kl_sum)
