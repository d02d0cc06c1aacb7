"""ORPO / SimPO / CPO (`posttrain.algorithms.preference`): hand values computed with plain `math`, and the
same inputs through TRL's own `ORPOTrainer.odds_ratio_loss` / `CPOTrainer.cpo_loss` (called unbound with a
stand-in `self` holding the config attributes they read), all to 1e-6."""
import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import cpo_loss, orpo_loss, simpo_loss

# two pairs: token-mean log-probs a (ORPO, SimPO) and summed log-probs π = a·|y| (CPO)
A_C, A_R = [-0.5, -2.0], [-1.2, -0.3]
PI_C, PI_R = [-1.0, -8.0], [-3.6, -0.6]  # |y_c| = 2, 4; |y_r| = 3, 2


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def logsig(z: float) -> float:
    return -math.log1p(math.exp(-z))


def mean(xs) -> float:
    return sum(xs) / len(xs)


def hand_orpo(ac, ar, lam):
    """-λ logσ(L), L = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)), per pair."""
    log_odds = [(c - r) - (math.log(1 - math.exp(c)) - math.log(1 - math.exp(r))) for c, r in zip(ac, ar)]
    return [-lam * logsig(x) for x in log_odds], log_odds


def hand_sigmoid(chosen, rejected, beta, gamma, eps):
    """-(1-ε) logσ(β(c - r) - γ) - ε logσ(γ - β(c - r)), per pair."""
    return [-(1 - eps) * logsig(beta * (c - r) - gamma) - eps * logsig(gamma - beta * (c - r))
            for c, r in zip(chosen, rejected)]


def test_orpo_by_hand():
    term, chosen_r, rejected_r, log_odds = orpo_loss(t(A_C), t(A_R), lam=0.25)
    losses, odds = hand_orpo(A_C, A_R, 0.25)
    # pair 1: L = 0.7 - (log(1 - e^-0.5) - log(1 - e^-1.2)) = 0.7 - (-0.932752 + 0.358382) = 1.274370
    assert odds[0] == pytest.approx(1.274370, abs=1e-6)
    assert float(term) == pytest.approx(mean(losses), abs=1e-6)
    torch.testing.assert_close(log_odds, t(odds), atol=1e-6, rtol=0)
    torch.testing.assert_close(chosen_r, t([0.25 * a for a in A_C]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rejected_r, t([0.25 * a for a in A_R]), atol=1e-6, rtol=0)
    assert not log_odds.requires_grad


@pytest.mark.parametrize("beta, gamma, eps", [(2.0, 0.5, 0.0), (0.1, 0.5, 0.0), (2.5, 1.0, 0.2)])
def test_simpo_by_hand(beta, gamma, eps):
    loss, chosen_r, rejected_r = simpo_loss(t(A_C), t(A_R), beta=beta, gamma=gamma, label_smoothing=eps)
    assert float(loss) == pytest.approx(mean(hand_sigmoid(A_C, A_R, beta, gamma, eps)), abs=1e-6)
    torch.testing.assert_close(chosen_r - rejected_r, t([beta * (c - r) for c, r in zip(A_C, A_R)]),
                               atol=1e-6, rtol=0)
    if (beta, gamma, eps) == (2.0, 0.5, 0.0):  # pair 1: -logσ(2·0.7 - 0.5) = -logσ(0.9) = 0.341154
        assert hand_sigmoid(A_C[:1], A_R[:1], beta, gamma, eps)[0] == pytest.approx(0.341154, abs=1e-6)


@pytest.mark.parametrize("beta, eps", [(0.1, 0.0), (0.5, 0.3)])
def test_cpo_by_hand(beta, eps):
    loss, chosen_r, rejected_r = cpo_loss(t(PI_C), t(PI_R), beta=beta, label_smoothing=eps)
    assert float(loss) == pytest.approx(mean(hand_sigmoid(PI_C, PI_R, beta, 0.0, eps)), abs=1e-6)
    torch.testing.assert_close(chosen_r, t([beta * p for p in PI_C]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rejected_r, t([beta * p for p in PI_R]), atol=1e-6, rtol=0)


def test_orpo_gradient_moves_chosen_up_and_rejected_down():
    ac, ar = t(A_C).requires_grad_(), t(A_R).requires_grad_()
    orpo_loss(ac, ar, lam=1.0)[0].backward()
    assert (ac.grad < 0).all() and (ar.grad > 0).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="must be 1-D"):
        simpo_loss(t([[-1.0]]), t([[-1.0]]))
    with pytest.raises(ValueError, match="must match"):
        cpo_loss(t([-1.0, -2.0]), t([-1.0]))
    with pytest.raises(ValueError, match="label_smoothing"):
        simpo_loss(t(A_C), t(A_R), label_smoothing=0.7)
    with pytest.raises(ValueError, match="lam"):
        orpo_loss(t(A_C), t(A_R), lam=-1.0)


# ---- TRL 1.16's own loss methods on the same inputs -------------------------------------------------
def trl_self(**config):
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), **config)


@pytest.mark.parametrize("lam", [0.1, 0.25])
def test_orpo_matches_trl_odds_ratio_loss(lam):
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    # TRL returns beta·logσ(L) (its loss subtracts the mean from the NLL), the rewards and mean log odds
    losses, chosen_r, rejected_r, _, mean_log_odds = ORPOTrainer.odds_ratio_loss(trl_self(beta=lam), t(A_C),
                                                                                  t(A_R))
    term, ours_c, ours_r, log_odds = orpo_loss(t(A_C), t(A_R), lam=lam)
    assert float(term) == pytest.approx(float(-losses.mean()), abs=1e-6)
    assert float(log_odds.mean()) == pytest.approx(float(mean_log_odds), abs=1e-6)
    torch.testing.assert_close(ours_c, chosen_r, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours_r, rejected_r, atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss_type, beta, gamma, eps", [
    ("simpo", 2.0, 0.5, 0.0), ("simpo", 0.1, 0.5, 0.2), ("sigmoid", 0.1, 0.0, 0.0),
    ("sigmoid", 0.5, 0.0, 0.3)])
def test_simpo_and_cpo_match_trl_cpo_loss(loss_type, beta, gamma, eps):
    """TRL's SimPO is CPOTrainer with loss_type simpo (on token means, the γ/β shift inside β·(...));
    its CPO is loss_type sigmoid on summed log-probs."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    me = trl_self(alpha=0.0, loss_type=loss_type, beta=beta, simpo_gamma=gamma, label_smoothing=eps)
    chosen, rejected = (A_C, A_R) if loss_type == "simpo" else (PI_C, PI_R)
    losses, chosen_r, rejected_r = CPOTrainer.cpo_loss(me, t(chosen), t(rejected))
    if loss_type == "simpo":
        ours = simpo_loss(t(chosen), t(rejected), beta=beta, gamma=gamma, label_smoothing=eps)
    else:
        ours = cpo_loss(t(chosen), t(rejected), beta=beta, label_smoothing=eps)
    assert float(ours[0]) == pytest.approx(float(losses.mean()), abs=1e-6)
    torch.testing.assert_close(ours[1], chosen_r, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[2], rejected_r, atol=1e-6, rtol=0)
