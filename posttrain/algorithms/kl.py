"""Per-token KL estimators between the policy and the reference, and KL-coefficient controllers.

With ``d = logp - ref_logp`` (log-probs of tokens sampled from the policy):
``k1 = d``, ``k2 = d²/2``, ``k3 = exp(-d) - 1 + d`` (Schulman's estimators of KL(π‖ref)).

Gradients when used as a loss (``kl_coef · aggregate(approx_kl(logp, ref_logp))``, samples from π,
gradient through ``logp`` only) -- tested exactly on a categorical example:
- ``k2``: the gradient of the reverse KL ``KL(π‖ref)`` (the one to use for a KL loss);
- ``k1``: zero in expectation (its value is unbiased, its gradient is useless);
- ``k3``: the gradient of the forward KL ``KL(ref‖π)``.
"""
from __future__ import annotations

import math

import torch

from ._util import check_choice, check_shape, f32, masked_mean


def _k1(d: torch.Tensor) -> torch.Tensor:
    return d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d * d


def _k3(d: torch.Tensor) -> torch.Tensor:
    # expm1 avoids cancellation near d = 0 (and the floor at 0 absorbs the last rounding ulp);
    # -d is capped at 50 inside exp so far-off tokens give a huge finite value, never inf/NaN grads.
    return (torch.expm1(-d.clamp(min=-50.0)) + d).clamp(min=0.0)


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def approx_kl_with_stats(logp, ref_logp, estimator="k1", clamp=10.0, mask=None):
    """``approx_kl`` plus ``{"kl_clamp_frac": fraction of (masked) positions whose estimate was
    clamped}`` (a detached 0-dim tensor) so callers can log it."""
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_shape("ref_logp", ref_logp, "logp", logp)
    if clamp is not None and not (isinstance(clamp, (int, float)) and clamp > 0):
        raise ValueError(f"clamp={clamp!r} must be None or a number > 0")
    raw = KL_ESTIMATORS[estimator](f32(logp) - f32(ref_logp))
    if clamp is None:
        kl, clamped = raw, torch.zeros_like(raw, dtype=torch.bool)
    else:
        kl = raw.clamp(-clamp, clamp)
        clamped = raw.detach().abs() > clamp
    if mask is None:
        mask = torch.ones_like(clamped)
    else:
        check_shape("mask", mask, "logp", logp)
    return kl, {"kl_clamp_frac": masked_mean(clamped.float(), mask).detach()}


def approx_kl(logp, ref_logp, estimator="k1", clamp=10.0):
    """Per-token KL estimate ``[B, A]`` (float32), clamped to ``[-clamp, clamp]`` unless clamp is None.

    Differentiable through ``logp`` (and ``ref_logp`` if it requires grad). Use
    ``approx_kl_with_stats`` to get the clamped fraction for logging."""
    return approx_kl_with_stats(logp, ref_logp, estimator, clamp)[0]


def _finite(name, value) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be finite")
    return value


class FixedKLController:
    """Constant KL coefficient: ``value`` never changes."""

    def __init__(self, coef):
        if _finite("coef", coef) < 0:
            raise ValueError(f"coef={coef!r} must be >= 0")
        self.value = float(coef)

    def update(self, current_kl, n_steps):
        """No-op (signature shared with AdaptiveKLController)."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


MAX_COEF = 1e6  # the adaptive coefficient's ceiling (finite whatever the horizon)


class AdaptiveKLController:
    """Ziegler et al. proportional controller steering the measured KL toward ``target``, with
    ``e = clip(current_kl / target - 1, -0.2, 0.2)`` and ``x = n_steps / horizon``:
    ``value *= 1 + e·x`` when ``x <= 1`` (OpenRLHF's update, exactly), and ``value *= (1 + e)^x``
    when ``x > 1`` (**[beyond]**: the same per-horizon change compounded; OpenRLHF's linear factor
    turns negative for ``x > 5`` and would flip the coefficient's sign, rewarding divergence).
    Both agree at ``x = 1``; the coefficient stays > 0 (``compounded`` records that an update took
    the second branch, for a warning).

    ``current_kl`` is OpenRLHF's statistic: the mean over the step's samples of each sample's
    token-mean KL (the training-time KL loss with ``--algo.kl.use_loss``); ``n_steps`` the samples
    of the step."""

    def __init__(self, init_coef, target, horizon):
        if _finite("init_coef", init_coef) < 0:
            raise ValueError(f"init_coef={init_coef!r} must be >= 0")
        if _finite("target", target) <= 0:
            raise ValueError(f"target={target!r} must be > 0")
        if _finite("horizon", horizon) <= 0:
            raise ValueError(f"horizon={horizon!r} must be > 0")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)
        self.compounded = False

    def update(self, current_kl, n_steps):
        current = _finite("current_kl", current_kl)
        n = _finite("n_steps", n_steps)
        if n < 0:
            raise ValueError(f"n_steps={n_steps!r} must be >= 0")
        error = min(max(current / self.target - 1.0, -0.2), 0.2)
        x = n / self.horizon
        self.compounded = x > 1
        # exp(x·log(1+e)) = (1+e)^x; the exponent and the coefficient are bounded so that no horizon /
        # sample count overflows (a coefficient of MAX_COEF already pins the policy to the reference)
        factor = (math.exp(max(min(x * math.log1p(error), 50.0), -50.0)) if self.compounded
                  else 1.0 + error * x)
        self.value = min(self.value * factor, MAX_COEF)

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = float(state["horizon"])
