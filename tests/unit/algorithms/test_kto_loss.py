"""KTO's loss (`algorithms.preference.kto_loss`): values by hand for both loss types and the weights, the KL
term clamped at 0 and detached, and the same inputs through TRL 1.16's own `KTOTrainer._compute_loss` (a
stand-in trainer whose model returns fixed per-token log-probs) to 1e-6, gradients included."""
import functools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms.preference import kto_loss

POLICY = [-3.0, -5.5, -2.25, -7.0, -4.0]
REF = [-3.5, -5.0, -2.0, -6.0, -4.75]
LABELS = [True, False, True, False, False]
POLICY_KL = [-6.0, -4.0, -3.0, -8.0, -5.0]  # π(y'|x) of the mismatched pairs
REF_KL = [-6.5, -4.25, -3.5, -7.5, -5.25]


def t(x, **kw):
    return torch.tensor(x, dtype=torch.float32, **kw)


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def by_hand(kl: float, beta: float, wd: float, wu: float, loss_type: str) -> list[float]:
    z0 = max(kl, 0.0)
    out = []
    for p, r, good in zip(POLICY, REF, LABELS):
        lr = p - r
        if loss_type == "kto":
            out.append(wd * (1 - sig(beta * (lr - z0))) if good else wu * (1 - sig(beta * (z0 - lr))))
        else:
            out.append(wd * (1 - sig(beta * lr)) if good else wu * sig(beta * lr))
    return out


@pytest.mark.parametrize("kl,beta,wd,wu,loss_type", [
    (0.3, 0.1, 1.0, 1.0, "kto"), (0.3, 0.5, 1.33, 0.7, "kto"), (-0.4, 0.2, 1.0, 2.0, "kto"),
    (0.3, 0.5, 1.33, 0.7, "apo_zero_unpaired")])
def test_losses_and_rewards_by_hand(kl, beta, wd, wu, loss_type):
    losses, rewards = kto_loss(t(POLICY), t(REF), torch.tensor(LABELS), kl, beta=beta, desirable_weight=wd,
                               undesirable_weight=wu, loss_type=loss_type)
    assert losses.tolist() == pytest.approx(by_hand(kl, beta, wd, wu, loss_type), abs=1e-6)
    assert rewards.tolist() == pytest.approx([beta * (p - r) for p, r in zip(POLICY, REF)], abs=1e-6)


def test_half_the_weight_at_the_reference_and_the_kl_term_carries_no_gradient():
    losses, _ = kto_loss(t(REF), t(REF), torch.tensor(LABELS), 0.0, desirable_weight=2.0)
    assert losses.tolist() == pytest.approx([1.0 if g else 0.5 for g in LABELS], abs=1e-7)
    kl = t(0.7, requires_grad=True)
    policy = t(POLICY, requires_grad=True)
    kto_loss(policy, t(REF), torch.tensor(LABELS), kl)[0].sum().backward()
    assert kl.grad is None and policy.grad.abs().min() > 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="loss_type"):
        kto_loss(t(POLICY), t(REF), torch.tensor(LABELS), 0.0, loss_type="sigmoid")
    with pytest.raises(ValueError, match="undesirable_weight"):
        kto_loss(t(POLICY), t(REF), torch.tensor(LABELS), 0.0, undesirable_weight=-1.0)
    with pytest.raises(ValueError, match="desirable"):
        kto_loss(t(POLICY), t(REF), torch.tensor(LABELS[:2]), 0.0)


class _FixedLogps:
    """A stand-in model for TRL's fused-LM-head forward: per-token log-probs whose sum over a row is the
    given value (first position), for the KL batch or the completion batch."""

    training = True

    def __init__(self, kl_input_ids, kl_logps, logps):
        self.kl_input_ids, self.kl_logps, self.logps = kl_input_ids, kl_logps, logps

    def __call__(self, input_ids, labels, **kw):
        sums = self.kl_logps if input_ids is self.kl_input_ids else self.logps
        rows, width = input_ids.shape
        per_token = torch.cat([sums[:, None], torch.zeros(rows, width - 2)], dim=1)
        zeros = torch.zeros(rows, width - 1)
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros)


@pytest.mark.parametrize("loss_type,beta,wd,wu", [("kto", 0.1, 1.0, 1.0), ("kto", 0.5, 1.33, 0.7),
                                                   ("apo_zero_unpaired", 0.5, 1.33, 0.7)])
def test_equals_trls_kto_trainer(loss_type, beta, wd, wu):
    """TRL's `_compute_loss` with precomputed reference log-probs (a stand-in trainer, no model download):
    its KL term is mean(π_KL - ref_KL) clamped at 0, its loss the mean of the weighted row losses."""
    from trl.trainer.kto_trainer import KTOTrainer

    n, width = len(POLICY), 4
    ids = torch.arange(n * width).view(n, width)
    kl_ids = ids + 100
    mask = torch.tensor([[0, 1, 1, 1]] * n)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": mask,
             "KL_input_ids": kl_ids, "KL_attention_mask": torch.ones_like(ids), "KL_completion_mask": mask,
             "label": torch.tensor(LABELS), "ref_logps": t(REF), "ref_KL_logps": t(REF_KL)}
    trl_policy = t(POLICY, requires_grad=True)
    model = _FixedLogps(kl_ids, t(POLICY_KL), trl_policy)
    stand_in = SimpleNamespace(
        model=model,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        calculate_KL=loss_type == "kto", precompute_ref_logps=True, aux_loss_enabled=False, beta=beta,
        loss_type=loss_type, desirable_weight=wd, undesirable_weight=wu,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    stand_in._compute_kl_logps = functools.partial(KTOTrainer._compute_kl_logps, stand_in)
    trl_loss = KTOTrainer._compute_loss(stand_in, model, batch, return_outputs=False)
    trl_loss.backward()

    ours_policy = t(POLICY, requires_grad=True)
    kl = (t(POLICY_KL) - t(REF_KL)).mean() if loss_type == "kto" else 0.0
    losses, _ = kto_loss(ours_policy, t(REF), torch.tensor(LABELS), kl, beta=beta, desirable_weight=wd,
                         undesirable_weight=wu, loss_type=loss_type)
    losses.mean().backward()
    assert losses.mean().item() == pytest.approx(trl_loss.item(), abs=1e-6)
    torch.testing.assert_close(ours_policy.grad, trl_policy.grad, atol=1e-6, rtol=0)
    if loss_type == "kto":
        assert stand_in._metrics["train"]["kl"] == [pytest.approx(max(float(kl), 0.0), abs=1e-6)]
