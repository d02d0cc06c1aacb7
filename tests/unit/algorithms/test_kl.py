"""KL estimators (hand values), the KL-as-loss gradient (test #2) and the KL controllers."""
import math

import pytest
import torch

from posttrain.algorithms import AdaptiveKLController, FixedKLController, approx_kl, approx_kl_with_stats

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])  # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize("estimator, expected", [
    ("k1", [0.5, -1.0]),
    ("k2", [0.125, 0.5]),                          # d²/2
    ("k3", [0.10653065971, 0.71828182846]),        # e^-0.5 - 1 + 0.5 ; e^1 - 1 - 1
])
def test_estimators_hand_values(estimator, expected):
    torch.testing.assert_close(approx_kl(LOGP, REF, estimator), torch.tensor([expected]))


def test_k1_can_be_negative_k2_k3_cannot():
    assert approx_kl(LOGP, REF, "k1")[0, 1] < 0
    assert (approx_kl(LOGP, REF, "k2") >= 0).all() and (approx_kl(LOGP, REF, "k3") >= 0).all()


def test_clamp_and_clamp_fraction_reported():
    logp, ref = torch.tensor([[20.0, -3.0, 0.0, 0.0]]), torch.zeros(1, 4)
    kl, stats = approx_kl_with_stats(logp, ref, "k1", clamp=10.0)
    torch.testing.assert_close(kl, torch.tensor([[10.0, -3.0, 0.0, 0.0]]))
    assert stats["kl_clamp_frac"].item() == pytest.approx(0.25)
    # with a mask only masked positions count: 1 clamped of 2 masked
    _, stats = approx_kl_with_stats(logp, ref, "k1", clamp=10.0, mask=torch.tensor([[1, 1, 0, 0]]))
    assert stats["kl_clamp_frac"].item() == pytest.approx(0.5)
    kl, stats = approx_kl_with_stats(logp, ref, "k1", clamp=None)
    assert kl[0, 0].item() == 20.0 and stats["kl_clamp_frac"].item() == 0.0


def test_float32_and_finite_gradient_for_far_tokens():
    logp = torch.tensor([[-100.0, 0.5]], dtype=torch.bfloat16, requires_grad=True)
    kl = approx_kl(logp, torch.zeros(1, 2), "k3", clamp=None)
    assert kl.dtype == torch.float32 and torch.isfinite(kl).all()
    kl.sum().backward()
    assert torch.isfinite(logp.grad.float()).all()


# --- Test #2: KL as a loss vs the analytic reverse-KL gradient ------------------------------------
# Policy pi = softmax(theta) over 4 actions, reference q. The KL loss is the on-policy expectation
# E_{a~pi}[k(log pi_a - log q_a)] with the sampling distribution held fixed (stop-gradient), i.e. what
# the trainer's sample average converges to; we evaluate it exactly by enumerating the actions.
THETA = [0.3, -0.2, 1.1, -0.7]
Q = torch.softmax(torch.tensor([0.5, 0.1, -0.4, 0.2]), 0)


def _kl_loss_grad(estimator):
    theta = torch.tensor(THETA, requires_grad=True)
    logp = torch.log_softmax(theta, 0)
    kl = approx_kl(logp[None], Q.log()[None], estimator, clamp=None)[0]
    (logp.exp().detach() * kl).sum().backward()
    return theta.grad


def test_k2_loss_gradient_is_reverse_kl_gradient():
    pi = torch.softmax(torch.tensor(THETA), 0)
    reverse_kl = (pi * (pi / Q).log()).sum()
    analytic = pi * ((pi / Q).log() - reverse_kl)  # d KL(pi||q) / d theta_j
    torch.testing.assert_close(_kl_loss_grad("k2"), analytic, atol=1e-6, rtol=1e-5)
    # and against autograd of the exact reverse KL
    theta = torch.tensor(THETA, requires_grad=True)
    logp = torch.log_softmax(theta, 0)
    (logp.exp() * (logp - Q.log())).sum().backward()
    torch.testing.assert_close(_kl_loss_grad("k2"), theta.grad, atol=1e-6, rtol=1e-5)


def test_k1_loss_gradient_is_zero_and_k3_is_forward_kl_gradient():
    pi = torch.softmax(torch.tensor(THETA), 0)
    torch.testing.assert_close(_kl_loss_grad("k1"), torch.zeros(4), atol=1e-6, rtol=0)
    # d KL(q||pi) / d theta = pi - q, which differs from the reverse-KL gradient
    torch.testing.assert_close(_kl_loss_grad("k3"), pi - Q, atol=1e-6, rtol=1e-5)
    reverse = pi * ((pi / Q).log() - (pi * (pi / Q).log()).sum())
    assert (pi - Q - reverse).abs().max() > 1e-2


# --- controllers -----------------------------------------------------------------------------------
def test_adaptive_controller_check_value():
    c = AdaptiveKLController(init_coef=0.01, target=0.1, horizon=10000)
    c.update(0.2, 1024)
    assert c.value == pytest.approx(0.0102048, rel=1e-9)


@pytest.mark.parametrize("current, expected", [
    (0.05, 0.01 * 0.97952),   # error -0.5 clipped to -0.2: 1 - 0.2 * 0.1024
    (0.11, 0.01 * 1.01024),   # error 0.1 inside the band: 1 + 0.1 * 0.1024
    (0.1, 0.01),              # on target: unchanged
])
def test_adaptive_controller_hand_values(current, expected):
    c = AdaptiveKLController(0.01, 0.1, 10000)
    c.update(current, 1024)
    assert c.value == pytest.approx(expected, rel=1e-9)


def test_fixed_controller_never_changes_and_state_round_trips():
    c = FixedKLController(0.05)
    c.update(123.0, 1000)
    assert c.value == 0.05
    a = AdaptiveKLController(0.01, 0.1, 10000)
    a.update(0.3, 500)
    b = AdaptiveKLController(1.0, 1.0, 1.0)
    b.load_state_dict(a.state_dict())
    a.update(0.01, 500), b.update(0.01, 500)
    assert a.value == b.value and not math.isclose(a.value, 0.01)


def test_adaptive_kl_with_many_samples_per_step_stays_positive_and_keeps_working():
    """Horizon 100, 1024 samples per step (x = 10.24), KL far below target: OpenRLHF's factor
    1 - 0.2 * 10.24 = -1.048 would flip the coefficient's sign; ours compounds the per-horizon change,
    0.8 ** 10.24, and the controller keeps working (it can grow back)."""
    c = AdaptiveKLController(0.05, target=1.0, horizon=100)
    c.update(0.0, 1024)
    assert c.value == pytest.approx(0.05 * 0.8 ** 10.24) and c.value > 0 and c.compounded
    low = c.value
    c.update(2.0, 1024)  # above target
    assert c.value == pytest.approx(low * 1.2 ** 10.24)
    c = AdaptiveKLController(0.05, target=1.0, horizon=100)
    c.update(2.0, 100)  # x = 1: both branches agree with OpenRLHF's 1 + 0.2
    assert c.value == pytest.approx(0.06) and not c.compounded
