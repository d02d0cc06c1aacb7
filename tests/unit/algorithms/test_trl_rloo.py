"""TRL RLOO (v0.14-v0.21, spec'd against v0.21.0) through posttrain.algorithms only: the missing-EOS
penalty, batch reward normalisation with its clip, sequence-level advantage whitening and the
sequence-sum ratio loss, against a vendored hand computation of TRL v0.21.0's RLOOTrainer, plus hand
values for each new function."""
import math

import pytest
import torch

from posttrain import algorithms as A
from posttrain.algorithms import (
    approx_kl,
    batch_normalize_scores,
    compute_advantages,
    missing_eos_penalty,
    policy_loss,
    whiten,
    whiten_sequences,
)

close = torch.testing.assert_close


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# ---- vendored from TRL v0.21.0 RLOOTrainer semantics (docs/from-trl.md, docs/algorithms.md "TRL RLOO") ----
# Layout: TRL sample-major rows [p0 s0, p1 s0, p0 s1, p1 s1]; to posttrain group-contiguous use PERM.
RLOO_K, NUM_PROMPTS, RESPONSE_LENGTH = 2, 2, 4
PAD_ID, EOS_ID = 0, 2              # stop_token="eos" -> stop_token_id = EOS_ID
KL_COEF, MISSING_EOS_PENALTY, CLIPRANGE = 0.1, 1.0, 0.2
PERM = [0, 2, 1, 3]                # posttrain row j = TRL row PERM[j]
RESPONSES = [[5, 2, 7, 8], [6, 7, 9, 3], [4, 5, 2, 9], [2, 3, 3, 3]]          # raw, generated (fixed length)
LOGPROBS = [[-0.5, -1.2, -2.0, -0.3], [-0.8, -0.6, -1.1, -0.9],  # rollout/old, temperature-scaled;
            [-1.0, -0.4, -0.7, -2.5], [-0.2, -1.5, -0.9, -1.3]]  # values at pad positions are ignored
REF_LOGPROBS = [[-0.7, -1.1, -1.8, -0.6], [-1.1, -0.5, -1.6, -0.7],
                [-0.9, -0.8, -0.6, -1.0], [-0.4, -1.2, -0.5, -0.8]]
SCORES = [1.0, 2.5, -0.5, 0.3]  # RM output on postprocessed responses
NEW_LOGPROBS = [[-0.3, -1.0, -5.0, -5.0], [-0.85, -0.65, -1.05, -0.95],
                [-1.1, -0.5, -0.9, -5.0], [-0.1, -5.0, -5.0, -5.0]]

EXPECTED_POSTPROCESSED = [[5, 2, 0, 0], [6, 7, 9, 3], [4, 5, 2, 0], [2, 0, 0, 0]]
EXPECTED_SEQUENCE_LENGTHS = [1, 3, 2, 0]             # index of last kept token
EXPECTED_PADDING_MASK = [[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 1, 1]]   # 1 = padding
EXPECTED_CONTAIN_EOS = [True, False, True, True]
EXPECTED_SEQ_KL = [0.1, 0.5, 0.2, 0.2]               # sum over kept tokens of (logprob - ref_logprob)

EXPECTED = {
    # (normalize_reward, reward_clip_range, token_level_kl, normalize_advantage)
    "default": dict(
        flags=(False, 10.0, False, False),
        scores=[1.0, 1.5, -0.5, 0.3],
        rlhf_reward=[0.99, 1.45, -0.52, 0.28],
        advantages=[1.51, 1.17, -1.51, -1.17],
        ratio=[1.4918246976, 0.9048374180, 0.6703200460, 1.1051709181],
        pg_loss=-0.0924024512,
        grad_row_per_kept_token=[0.0, -0.2646649448, 0.0, 0.3232624935],
    ),
    "token_level_kl": dict(                            # identical to "default"
        flags=(False, 10.0, True, False),
        rlhf_reward=[0.99, 1.45, -0.52, 0.28],
        advantages=[1.51, 1.17, -1.51, -1.17],
        pg_loss=-0.0924024512,
    ),
    "normalize_reward": dict(
        flags=(True, 10.0, False, False),
        scores=[0.4888503208, 1.0639683453, -1.2365037527, -0.3163149135],
        rlhf_reward=[0.4788503208, 1.0139683453, -1.2565037527, -0.3363149135],
        advantages=[1.7353540735, 1.3502832588, -1.7353540735, -1.3502832588],
        pg_loss=-0.1059086645,
        grad_row_per_kept_token=[0.0, -0.3054467044, 0.0, 0.3730734472],
    ),
    "normalize_reward_clip_0.5": dict(
        flags=(True, 0.5, False, False),
        scores=[0.4888503208, 0.5, -0.5, -0.3163149135],
        rlhf_reward=[0.4788503208, 0.45, -0.52, -0.3363149135],
        advantages=[0.9988503208, 0.7863149135, -0.9988503208, -0.7863149135],
        pg_loss=-0.0605037274,
        grad_row_per_kept_token=[0.0, -0.1778717890, 0.0, 0.2172530937],
    ),
    "normalize_advantage": dict(
        flags=(False, 10.0, False, True),
        rlhf_reward=[0.99, 1.45, -0.52, 0.28],
        advantages=[0.9681343788, 0.7501438564, -0.9681343788, -0.7501438564],
        pg_loss=-0.0592437018,
        grad_row_per_kept_token=[0.0, -0.1696895576, 0.0, 0.2072592936],
    ),
    "all": dict(
        flags=(True, 0.5, True, True),
        rlhf_reward=[0.4788503208, 0.45, -0.52, -0.3363149135],
        advantages=[0.9623350123, 0.7575693336, -0.9623350123, -0.7575693336],
        pg_loss=-0.0582918722,
        grad_row_per_kept_token=[0.0, -0.1713692700, 0.0, 0.2093108990],
    ),
}

# Leave-one-out baseline with rloo_k=3 (sample-major rlhf_reward, P=2): reshape(3, 2)
RLHF_K3 = [1.0, 4.0, 2.0, 6.0, 6.0, 5.0]
EXPECTED_ADV_K3 = [-3.0, -1.5, -1.5, 1.5, 4.5, 0.0]
EXPECTED_ADV_K3_NORMALIZED = [-1.1180339846, -0.5590169923, -0.5590169923, 0.5590169923, 1.6770509769, 0.0]
# ---- end of vendored data ----


def group_order(rows, perm=PERM):
    """TRL sample-major rows -> posttrain group-contiguous rows."""
    return t([rows[i] for i in perm])


def trl_pipeline(normalize_reward, reward_clip_range, normalize_advantage):
    """TRL's RLOO step on the vendored batch with posttrain.algorithms only, in posttrain's row order:
    scores -> missing_eos_penalty -> batch_normalize_scores -> rloo with sequence-level k1 KL (no KL
    clamp, no post-baseline clip) -> sequence whitening -> seq_sum loss (its auto aggregation)."""
    mask = 1 - group_order(EXPECTED_PADDING_MASK)
    has_eos = ((group_order(RESPONSES) == EOS_ID) & (mask > 0)).any(-1)
    scores = missing_eos_penalty(group_order(SCORES), has_eos, MISSING_EOS_PENALTY)
    if normalize_reward:
        scores = batch_normalize_scores(scores, reward_clip_range)
    old, ref = group_order(LOGPROBS), group_order(REF_LOGPROBS)
    kl = approx_kl(old, ref, "k1", clamp=None)
    adv, _ = compute_advantages("rloo", scores, mask, n=RLOO_K, kl=kl, kl_coef=KL_COEF, clip_range=None,
                                sequence_kl=True, whiten=normalize_advantage or None, whiten_level="sequence")
    new = group_order(NEW_LOGPROBS).requires_grad_()
    loss, metrics = policy_loss(new, old, adv, mask, eps_low=CLIPRANGE, eps_high=CLIPRANGE,
                                loss_type="seq_sum", agg="seq_mean_token_mean")
    loss.backward()
    return dict(mask=mask, has_eos=has_eos, scores=scores, kl=kl, advantages=adv, pg_loss=loss, grad=new.grad,
                metrics=metrics)


def row_values(x, mask):
    """The one value every masked token of a row carries (checked constant)."""
    m = mask > 0
    first = torch.where(m, x, 0.0).sum(-1) / m.sum(-1)
    close(torch.where(m, x, 0.0), torch.where(m, first[:, None].expand_as(x), 0.0))
    return first


TOL = dict(rtol=1e-5, atol=1e-6)


def test_vendored_rollout_facts_in_posttrain_order():
    out = trl_pipeline(False, 10.0, False)
    assert out["has_eos"].tolist() == [EXPECTED_CONTAIN_EOS[i] for i in PERM]
    close(out["kl"].mul(out["mask"]).sum(-1), group_order(EXPECTED_SEQ_KL), **TOL)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_trl_rloo_variant(name):
    exp = EXPECTED[name]
    normalize_reward, clip, _token_level_kl, normalize_advantage = exp["flags"]  # token_level_kl: no effect
    out = trl_pipeline(normalize_reward, clip, normalize_advantage)
    mask = out["mask"]
    if "scores" in exp:
        close(out["scores"], group_order(exp["scores"]), **TOL)
    rlhf = out["scores"] - KL_COEF * out["kl"].mul(mask).sum(-1)
    close(rlhf, group_order(exp["rlhf_reward"]), **TOL)
    close(row_values(out["advantages"], mask), group_order(exp["advantages"]), **TOL)
    close(out["pg_loss"], torch.tensor(exp["pg_loss"]), **TOL)
    grad_rows = exp.get("grad_row_per_kept_token", EXPECTED["default"]["grad_row_per_kept_token"])
    close(out["grad"], group_order(grad_rows)[:, None] * mask, **TOL)  # and exactly 0 at padding
    assert bool((out["grad"][mask == 0] == 0).all())


def test_trl_sequence_ratio_and_clipping():
    """ρ = exp(Σ_t (new - old)) over kept tokens; rows 0 and 2 (TRL order) take the clipped side."""
    out = trl_pipeline(False, 10.0, False)
    mask = out["mask"]
    diff = (group_order(NEW_LOGPROBS) - group_order(LOGPROBS)).mul(mask).sum(-1)
    close(diff.exp(), group_order(EXPECTED["default"]["ratio"]), **TOL)
    clipped_tokens = group_order([2, 0, 3, 0]).sum() / mask.sum()  # rows 0, 2 have 2 and 3 kept tokens
    close(out["metrics"]["clip_ratio"], clipped_tokens)


def test_rloo_k3_baseline_and_sequence_normalisation():
    perm = [0, 2, 4, 1, 3, 5]  # posttrain row p*3 + k = TRL row k*2 + p
    rewards, mask = group_order(RLHF_K3, perm), torch.ones(6, 2)
    adv, _ = compute_advantages("rloo", rewards, mask, n=3, clip_range=None)
    close(adv[:, 0], group_order(EXPECTED_ADV_K3, perm), **TOL)
    adv, _ = compute_advantages("rloo", rewards, mask, n=3, clip_range=None, whiten=True,
                                whiten_level="sequence")
    close(adv, group_order(EXPECTED_ADV_K3_NORMALIZED, perm)[:, None].expand(6, 2), **TOL)


# ---- each new function against hand values -----------------------------------------------------------
def test_missing_eos_penalty_subtracts_where_no_eos():
    close(missing_eos_penalty(t([1.0, 2.5, -0.5]), torch.tensor([True, False, False]), 1.0),
          t([1.0, 1.5, -1.5]))
    close(missing_eos_penalty(t([1.0, 2.0]), torch.tensor([1, 0]), 0.0), t([1.0, 2.0]))
    with pytest.raises(ValueError, match="penalty"):
        missing_eos_penalty(t([1.0]), torch.tensor([True]), float("nan"))
    with pytest.raises(ValueError, match="has_eos"):
        missing_eos_penalty(t([1.0]), torch.tensor([True, False]), 1.0)


def test_batch_normalize_scores_hand_values():
    close(batch_normalize_scores(t([1.0, 2.0, 3.0]), 10.0), t([-1.0, 0.0, 1.0]))  # unbiased std 1
    close(batch_normalize_scores(t([1.0, 2.0, 3.0]), 0.5), t([-0.5, 0.0, 0.5]))
    close(batch_normalize_scores(t([1.0, 5.0, 2.0, 3.0]), None, valid=torch.tensor([1, 0, 1, 1])),
          t([-1.0, 0.0, 0.0, 1.0]))  # the invalid sample neither counts nor keeps a value
    close(batch_normalize_scores(t([4.0, 4.0]), 10.0), t([0.0, 0.0]))  # std 0: no NaN
    close(batch_normalize_scores(t([7.0]), 10.0), t([0.0]))  # one sample: std taken as 0
    with pytest.raises(ValueError, match="clip"):
        batch_normalize_scores(t([1.0, 2.0]), -1.0)


def test_whiten_sequences_counts_each_sequence_once():
    adv = t([[1.0, 1.0], [2.0, 9.0], [3.0, 3.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    close(whiten_sequences(adv, mask), t([[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0]]))  # sequence std 1 (unbiased)
    close(whiten_sequences(adv, mask, use_std=False), t([[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0]]))
    # token level weighs each token: pop. std sqrt(0.8) over [1, 1, 2, 3, 3]
    close(whiten(adv, mask), t([[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0]]) / math.sqrt(0.8))
    # per-token values keep their spread: stats of the row means [0.5, 2.5] (std sqrt(2))
    close(whiten_sequences(t([[0.0, 1.0], [2.0, 3.0]]), torch.ones(2, 2)),
          t([[-1.5, -0.5], [0.5, 1.5]]) / math.sqrt(2.0))
    close(whiten_sequences(t([[2.0, 4.0]]), torch.ones(1, 2)), t([[-1.0, 1.0]]))  # one sequence: centred only
    with pytest.raises(ValueError, match="whiten_level"):
        compute_advantages("rloo", t([1.0, 2.0]), torch.ones(2, 1), n=2, whiten=True, whiten_level="batch")


def test_seq_sum_loss_hand_values():
    """Row 0: log ratio 0.1 + 0.2 = 0.3, ρ = e^0.3 = 1.35 clipped to 1.2 (Â = 1 > 0): ℓ = -1.2, no grad;
    row 1: ρ = e^-0.1, Â = token mean of [2, 4] = 3 (the padding's 100 ignored): ℓ = -3e^-0.1."""
    logp = t([[0.1, 0.2], [-0.1, 7.0]]).requires_grad_()
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = t([[1.0, 1.0], [3.0, 100.0]])
    loss, metrics = policy_loss(logp, torch.zeros(2, 2), adv, mask, loss_type="seq_sum",
                                agg="seq_mean_token_mean")
    assert loss.item() == pytest.approx((-1.2 - 3 * math.exp(-0.1)) / 2)
    assert metrics["clip_ratio"].item() == pytest.approx(2 / 3)
    loss.backward()
    close(logp.grad, t([[0.0, 0.0], [-3 * math.exp(-0.1) / 2, 0.0]]))
    adv2 = t([[2.0, 4.0], [3.0, 3.0]])  # a row's advantage is its token mean: 3 for both rows
    loss2, _ = policy_loss(torch.zeros(2, 2), torch.zeros(2, 2), adv2, torch.ones(2, 2), loss_type="seq_sum",
                           agg="seq_mean_token_mean")
    assert loss2.item() == pytest.approx(-3.0)


def test_seq_sum_with_is_correction_uses_rollout_ratio_like_gspo():
    w = [0.25, 1.0, 8.0]  # exp(old - rollout) with old = 0: Σ log w = log 2
    rollout = t([[-math.log(x) for x in w]])
    loss, _ = policy_loss(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3),
                          rollout_logp=rollout, is_correction="tis", loss_type="seq_sum",
                          agg="seq_mean_token_mean")
    assert loss.item() == pytest.approx(-1.2)  # ρ = 2 clipped to 1.2, no extra weight


def test_new_names_are_exported():
    assert "seq_sum" in A.POLICY_LOSSES and set(A.WHITEN_LEVELS) == {"token", "sequence"}
    for name in ("missing_eos_penalty", "batch_normalize_scores", "whiten_sequences"):
        assert name in A.__all__


# ---- the same batch through posttrain's trainer pieces, configured by a translated TRL config ---------
@pytest.mark.parametrize("name", list(EXPECTED))
def test_translated_trl_config_through_shaping_experience_and_loss(name):
    """`config_from_trl_rloo` of TRL's fields, then the trainer's own steps: reward shaping
    (`collect.shape_rewards`), `ExperienceMaker.make` (KL, baseline, whitening) and the policy loss with
    the config's loss type, aggregation and clip: TRL's advantages, loss and gradient."""
    from posttrain.config import config_from_trl_rloo
    from posttrain.rollout.single_turn import Rollout, ScoredRollouts
    from posttrain.trainers.rl.batch_forward import Batching
    from posttrain.trainers.rl.collect import ShapingSettings, shape_rewards
    from posttrain.trainers.rl.experience_maker import ExperienceMaker

    exp_values = EXPECTED[name]
    normalize_reward, clip, token_level_kl, normalize_advantage = exp_values["flags"]
    cfg = config_from_trl_rloo({"sft_model_path": "m", "dataset_name": "d", "total_episodes": 4,
                                "rloo_k": RLOO_K, "per_device_train_batch_size": 4, "kl_coef": KL_COEF,
                                "cliprange": CLIPRANGE, "missing_eos_penalty": MISSING_EOS_PENALTY,
                                "stop_token": "eos", "normalize_reward": normalize_reward,
                                "reward_clip_range": clip, "token_level_kl": token_level_kl,
                                "normalize_advantage": normalize_advantage},
                               ["--reward.remote_url", "r.py"])
    prompts = [[10, 11], [12, 13]]  # TRL row r: prompt r % 2
    rollouts, logps, refs = [], [], []
    for row in PERM:
        kept = RESPONSES[row][: EXPECTED_SEQUENCE_LENGTHS[row] + 1]  # the response up to its first EOS
        finish = "stop" if EOS_ID in kept else "length"
        rollouts.append(Rollout(prompt_ids=prompts[row % 2], output_ids=kept, finish_reason=finish,
                                rollout_logprobs=LOGPROBS[row][: len(kept)], prompt_text="",
                                response_text=""))
        logps.append(LOGPROBS[row][: len(kept)])
        refs.append(REF_LOGPROBS[row][: len(kept)])

    class Policy:
        def __init__(self, rows):
            self.rows = rows

        def logprobs(self, exp, batching):
            out = torch.zeros_like(exp.action_mask)
            for i, values in enumerate(self.rows):
                out[i, exp.action_mask[i].nonzero().flatten()] = t(values)
            return out

    scored = ScoredRollouts(rollouts, group_order(SCORES), group_order(SCORES), {},
                            torch.zeros(4, dtype=torch.bool))
    r = cfg.reward
    shape_rewards(scored, ShapingSettings(r.overlong_buffer_len, r.overlong_penalty_factor,
                                          r.stop_properly_penalty_coef, r.missing_eos_penalty, (EOS_ID,)))
    maker = ExperienceMaker(cfg, Policy(logps), Policy(refs), None, Batching(4), pad_id=PAD_ID)
    exp, _ = maker.make(scored, kl_coef=cfg.algo.kl.init_coef)
    mask = exp.action_mask
    close(row_values(exp.advantages, mask), group_order(exp_values["advantages"]), **TOL)
    new = Policy([NEW_LOGPROBS[row][: len(lp)] for row, lp in zip(PERM, logps)]).logprobs(exp, None)
    new.requires_grad_()
    a = cfg.actor
    loss, _ = policy_loss(new, exp.old_logp, exp.advantages, mask, eps_low=a.eps_clip, eps_high=a.eps_clip,
                          loss_type=a.policy_loss_type, agg=a.loss_agg)
    close(loss, torch.tensor(exp_values["pg_loss"]), **TOL)
    loss.backward()
    grad_rows = exp_values.get("grad_row_per_kept_token", EXPECTED["default"]["grad_row_per_kept_token"])
    close(new.grad, group_order(grad_rows)[:, None] * mask, **TOL)
