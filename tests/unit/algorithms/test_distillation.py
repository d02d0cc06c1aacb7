"""Distillation losses (algorithms/distillation.py) against values computed with plain Python math, and
against TRL 1.16's GKDTrainer.generalized_jsd_loss on the same logits."""
import math

import pytest
import torch

from posttrain.algorithms import KD_LOSSES, distillation_loss, generalized_jsd, kd_divergence

# two positions over a vocabulary of 3
STUDENT = [[1.0, 0.0, -1.0], [0.3, -0.2, 2.0]]
TEACHER = [[0.5, 0.2, 0.1], [-1.0, 1.5, 0.0]]


def softmax(z, tau=1.0):
    e = [math.exp(v / tau) for v in z]
    return [v / sum(e) for v in e]


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def hand(kind, s_logits, t_logits, beta=0.5, tau=1.0):
    s, t = softmax(s_logits, tau), softmax(t_logits, tau)
    if kind == "forward":
        return kl(t, s)
    if kind == "reverse":
        return kl(s, t)
    m = [beta * a + (1 - beta) * b for a, b in zip(t, s)]
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def tensors():
    return torch.tensor([STUDENT], dtype=torch.float64), torch.tensor([TEACHER], dtype=torch.float64)


@pytest.mark.parametrize("kind,beta,tau", [("forward", 0.5, 1.0), ("reverse", 0.5, 1.0), ("jsd", 0.5, 1.0),
                                           ("jsd", 0.2, 1.0), ("forward", 0.5, 2.0), ("jsd", 0.7, 0.5)])
def test_per_token_divergence_equals_hand_values(kind, beta, tau):
    s, t = tensors()
    got = kd_divergence(s, t, kind, beta=beta, temperature=tau)[0]
    want = [hand(kind, a, b, beta, tau) for a, b in zip(STUDENT, TEACHER)]
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert all(w > 0 for w in want)


def test_jsd_ends_are_the_two_kls_and_identical_distributions_give_zero():
    s, t = tensors()
    torch.testing.assert_close(generalized_jsd(s, t, 0.0), kd_divergence(s, t, "forward"))
    torch.testing.assert_close(generalized_jsd(s, t, 1.0), kd_divergence(s, t, "reverse"))
    for kind in KD_LOSSES:
        assert kd_divergence(s, s + 3.0, kind).abs().max() < 1e-6  # a shift of the logits: same softmax


def test_masked_token_mean_over_the_step_tokens():
    # mask the second position of row 0; a second row holds both positions again
    s = torch.tensor([STUDENT, STUDENT], dtype=torch.float64)
    t = torch.tensor([TEACHER, TEACHER], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 1]])
    d = [hand("forward", a, b) for a, b in zip(STUDENT, TEACHER)]
    local = distillation_loss(s, t, mask)  # Σ m d / Σ m
    assert float(local) == pytest.approx((2 * d[0] + d[1]) / 3, abs=1e-6)
    step = distillation_loss(s, t, mask, num_tokens=6)  # the step's 6 target tokens: this micro-batch's share
    assert float(step) == pytest.approx((2 * d[0] + d[1]) / 6, abs=1e-6)
    # two micro-batches of one step add up to the whole step's loss (the split does not change it)
    halves = sum(distillation_loss(s[i:i + 1], t[i:i + 1], mask[i:i + 1], num_tokens=3) for i in range(2))
    assert float(halves) == pytest.approx(float(local), abs=1e-7)


def test_gradient_reaches_the_student_only():
    s, t = tensors()
    s.requires_grad_(True)
    t.requires_grad_(True)
    distillation_loss(s, t, torch.ones(1, 2), "jsd").backward()
    assert t.grad is None and s.grad.abs().sum() > 0


def test_bad_arguments():
    s, t = tensors()
    with pytest.raises(ValueError, match="kind='kl'"):
        kd_divergence(s, t, "kl")
    with pytest.raises(ValueError, match="beta=1.5"):
        generalized_jsd(s, t, 1.5)
    with pytest.raises(ValueError, match="temperature=0"):
        generalized_jsd(s, t, 0.5, temperature=0)
    with pytest.raises(ValueError, match="teacher_logits has shape"):
        generalized_jsd(s, t[..., :2], 0.5)


@pytest.mark.filterwarnings("ignore:You are importing from .trl.experimental.")
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_equals_trl_generalized_jsd_loss(beta, tau):
    """TRL's GKD loss (a static method: called on the class) on the same logits and mask (labels -100 where
    masked), its token mean ("batchmean" over the unmasked tokens)."""
    from trl.experimental.gkd import GKDTrainer

    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g) * 2
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]])
    labels = torch.where(mask.bool(), 1, -100)
    trl = GKDTrainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=tau)
    kind = {0.0: "forward", 1.0: "reverse"}.get(beta, "jsd")
    ours = distillation_loss(s, t, mask, kind, beta=beta, temperature=tau)
    assert float(ours) == pytest.approx(float(trl), abs=1e-6)
    assert float(ours) > 0.1


@pytest.mark.parametrize("kind", KD_LOSSES)
def test_a_masked_vocabulary_row_of_minus_inf_adds_nothing(kind):
    """A head that masks a vocabulary row with -inf in both models (probability 0 on both sides) gives the
    divergence of the other rows, not NaN (0 · log 0 is 0)."""
    s, t = torch.tensor([[0.3, -1.0, 0.5]]), torch.tensor([[1.0, 0.2, -0.4]])
    inf = torch.full((1, 1), float("-inf"))
    masked = kd_divergence(torch.cat([s, inf], -1), torch.cat([t, inf], -1), kind)
    assert torch.isfinite(masked).all()
    torch.testing.assert_close(masked, kd_divergence(s, t, kind))
