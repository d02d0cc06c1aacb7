"""TRL 1.16's GRPO and RLOO losses against posttrain's, run in the test: `GRPOTrainer._compute_loss` and
`RLOOTrainer._compute_loss` on fixed log-probs (a stand-in `self` whose forward returns them), and
posttrain's policy loss + KL loss configured by the translation of the same TRL fields (`translate_trl`),
aggregated as the PPO trainer does (`updates.update_actor`): the same loss and gradient to 1e-6."""
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import aggregate, approx_kl, policy_loss
from posttrain.config import config_from_trl


@pytest.fixture(scope="module")
def trl_trainers():
    """TRL's trainer classes, imported here: importing them takes seconds (they import vLLM), which
    collecting the test suite should not pay."""
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    rloo = pytest.importorskip("trl.trainer.rloo_trainer")
    return grpo.GRPOTrainer, rloo.RLOOTrainer

B, T, MAX_LEN = 4, 5, 6
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
ADV = torch.tensor([1.3, -0.7, 0.4, -1.1])
OLD = torch.tensor([[-1.0, -0.5, -2.0, -0.3, -1.2], [-0.8, -1.6, -0.4, -9.0, -9.0],
                    [-1.1, -0.9, -0.2, -2.2, -9.0], [-0.6, -9.0, -9.0, -9.0, -9.0]])
REF = OLD + torch.tensor([[0.1, -0.2, 0.05, 0.3, -0.1], [-0.3, 0.2, 0.1, 0.0, 0.0],
                          [0.2, 0.1, -0.4, 0.1, 0.0], [-0.2, 0.0, 0.0, 0.0, 0.0]])
# new - old: ratios inside and outside [0.8, 1.28] and past delta 2 on both advantage signs
SHIFT = torch.tensor([[0.05, 0.5, -0.4, 0.9, 0.0], [0.8, -0.5, 0.1, 0.0, 0.0],
                      [-0.3, 0.2, 0.02, 0.15, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])


def _accelerator():
    return SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction="sum": x,
                           gather_for_metrics=lambda x: x)


def _trl_loss(trainer_cls, args, new, extra_inputs, **attrs):
    """TRL's `_compute_loss` on the fixed tensors; returns (loss, d loss / d new)."""
    new = new.clone().requires_grad_()
    entropies = torch.ones_like(new)
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (new, entropies, None), aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False, args=args,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=_accelerator(), _metrics={"train": defaultdict(list)}, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon, beta=args.beta,
        loss_type=getattr(args, "loss_type", None),
        importance_sampling_level=getattr(args, "importance_sampling_level", None),
        max_completion_length=args.max_completion_length, **attrs)
    prompt = torch.zeros(B, 2, dtype=torch.long)
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": MASK.long(),
              "advantages": ADV, **extra_inputs}
    loss = trainer_cls._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), new.grad


def _posttrain_loss(cfg, new, ref=None):
    """posttrain's actor loss on one micro-batch that is the whole optimizer step (`update_actor`'s terms)."""
    from posttrain.trainers.rl.ppo import SEQUENCE_POLICY_LOSSES

    a = cfg.actor
    new = new.clone().requires_grad_()
    eps_low, eps_high = a.eps_clip_low_high or (a.eps_clip, a.eps_clip)
    adv = ADV[:, None] * MASK
    counts = {"num_tokens": float(MASK.sum()), "num_seqs": float(B), "max_len": MAX_LEN}
    loss, _ = policy_loss(new, OLD, adv, MASK, eps_low=eps_low, eps_high=eps_high, dual_clip=a.dual_clip,
                          loss_type=a.policy_loss_type, agg=a.loss_agg, **counts)
    if cfg.algo.kl.use_loss:
        other = "token_mean" if a.policy_loss_type in SEQUENCE_POLICY_LOSSES else a.loss_agg
        kl = approx_kl(new, ref, cfg.algo.kl.estimator, clamp=cfg.algo.kl.clamp or None)
        loss = loss + cfg.algo.kl.init_coef * aggregate(kl, MASK, other, **counts)
    loss.backward()
    return loss.detach(), new.grad


GRPO_CASES = {
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "grpo_sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.1},
    "dapo_clip_higher_delta": {"epsilon_high": 0.28, "delta": 2.0},
    "grpo_kl": {"loss_type": "grpo", "beta": 0.04, "use_bias_correction_kl": False},
    "dr_grpo_sequence": {"loss_type": "dr_grpo", "importance_sampling_level": "sequence"},
    "dapo_kl_clip_higher": {"beta": 0.1, "use_bias_correction_kl": False, "epsilon_high": 0.28},
}


@pytest.mark.parametrize("name", list(GRPO_CASES))
def test_grpo_loss_equals_trls(name, trl_trainers):
    from trl import GRPOConfig

    fields = {"max_completion_length": MAX_LEN, "per_device_train_batch_size": B, "num_generations": 2,
              "max_steps": 1, **GRPO_CASES[name]}
    args = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none", **fields)
    cfg = config_from_trl({**fields, "model_name_or_path": "m", "dataset_name": "d"},
                          ["--reward.remote_url", "r.py"])
    new = OLD + SHIFT
    extra = {"old_per_token_logps": OLD, "num_items_in_batch": MASK.sum()}
    if args.beta:
        extra["ref_per_token_logps"] = REF
    expected, expected_grad = _trl_loss(trl_trainers[0], args, new, extra)
    loss, grad = _posttrain_loss(cfg, new, REF)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad * MASK, expected_grad * MASK, rtol=0, atol=1e-6)
    assert expected_grad.abs().sum() > 0


@pytest.mark.parametrize("epsilon_high", [None, 0.3])
def test_rloo_loss_equals_trls(epsilon_high, trl_trainers):
    from trl import RLOOConfig

    fields = {"max_completion_length": MAX_LEN, "per_device_train_batch_size": B, "num_generations": 2,
              "max_steps": 1, "epsilon_high": epsilon_high}
    args = RLOOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none", **fields)
    cfg = config_from_trl({**fields, "normalize_advantages": False, "model_name_or_path": "m",
                           "dataset_name": "d"}, ["--reward.remote_url", "r.py"])
    new = OLD + SHIFT / 4  # sequence ratios exp(sum) inside and outside the clip range
    expected, expected_grad = _trl_loss(trl_trainers[1], args, new, {"old_logps": (OLD * MASK).sum(1)})
    loss, grad = _posttrain_loss(cfg, new)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad * MASK, expected_grad * MASK, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fields", [{"scale_rewards": "group"}, {"scale_rewards": "none"},
                                    {"normalize_advantages": True, "beta": 0.0},
                                    {"normalize_advantages": False, "beta": 0.0}])
def test_advantages_equal_trls_formulas(fields):
    pytest.importorskip("trl")
    """The translated estimator, std eps and whitening through `compute_advantages` against TRL 1.16's
    advantage arithmetic (`_generate_and_score_completions`, written with TRL's own `nanstd`)."""
    from trl.trainer.utils import nanstd

    from posttrain.algorithms import compute_advantages

    cfg = config_from_trl({"model_name_or_path": "m", "dataset_name": "d", "max_steps": 1,
                           "num_generations": 4, **fields}, ["--reward.remote_url", "r.py"])
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 3.0, 3.5, -1.0, 0.25])
    groups = rewards.view(-1, 4)
    if "scale_rewards" in fields:  # GRPO
        expected = (groups - groups.mean(1, keepdim=True))
        if fields["scale_rewards"] == "group":
            expected = expected / (nanstd(groups, dim=1)[:, None] + 1e-4)
    else:  # RLOO: leave-one-out, optionally normalised over the batch
        expected = groups - (groups.sum(1, keepdim=True) - groups) / 3
        if fields["normalize_advantages"]:
            expected = (expected - expected.mean()) / (nanstd(expected) + 1e-4)
    adv = cfg.algo.advantage
    mask = torch.ones(8, 3)
    ours, _ = compute_advantages(adv.estimator, rewards, mask, n=4, std_eps=adv.std_eps,
                                 whiten=True if adv.whiten_enable else None,
                                 whiten_level=adv.whiten_level if adv.whiten_enable else "token")
    torch.testing.assert_close(ours[:, 0], expected.flatten(), rtol=0, atol=1e-6)
