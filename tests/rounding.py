"""Tolerances for the tests that compare a run on several ranks with the same run in one process.

The two runs differ only in the order of float sums (ranks' all-reduce, split matmuls, oneDNN's or torch's
blocking, the thread count), so each gradient element differs by at most GRAD_REL times the norm of its
gradient: fp32 rounds to 6e-8, and 1e-5 leaves ~170 roundings for sums of thousands of terms, on any CPU.

Adam turns that into a weight difference. Its update is lr · m / (√v + eps), m and v the bias-corrected
averages of the gradients and their squares; d(update)/dm <= lr / eps, and d(update)/d√v = lr · |m| / (√v +
eps)² <= lr / eps as long as |m| <= √v (Cauchy-Schwarz gives |m| <= 1.03 √v over the first 8 steps at
betas (0.9, 0.999), the steps these tests take). So one step moves a weight by at most about 2 · lr · δ / eps
more when each gradient element moves by δ, and T steps by the sum over them (earlier steps' weight
differences change later gradients only at second order). With the default eps 1e-8 that factor is 2e8 ·
lr, which turned rounding into 5e-5 on some machines; the equality runs therefore pass ADAM_EPS. With it a
wrong gradient scale still shows: for Adam, a gradient scaled by k is eps scaled by 1/k. (On the tiny
models the bounds are 6e-5 to 5e-4, rounding moved weights by 1.2e-7 to 2.4e-7 with 1 or 2 threads and
either linear, and a halved gradient moved them 5 to 10 times past the bound in the PPO, DPO and RM
runs.)
"""

GRAD_REL = 1e-5  # a gradient element's rounding difference, relative to its gradient's norm
# A gradient norm's: its elements' (GRAD_REL) and its own sum of squares' (another fp32 sum of thousands of
# terms) rounding, with a factor 50 to spare; a gradient scaled by the rank count (2) is far outside it.
NORM_REL = 1e-3
ADAM_EPS = 1e-3  # --adam.eps of the runs whose weights are compared


def adam_weight_tolerance(lr: float, grad_norms, eps: float = ADAM_EPS, max_norm: float = 1.0) -> float:
    """The most a weight may differ between two Adam runs at `lr` and `eps` whose optimizer steps had the
    gradient norms `grad_norms` (one per step, before clipping, from either run) and whose gradients differ
    only by rounding: the sum over the steps of 2 · lr · GRAD_REL · min(norm, max_norm) / eps (a gradient
    clipped to `max_norm`, the default of --max_norm, rounds at its clipped size; 0: no clipping)."""
    return sum(2 * lr * GRAD_REL * (min(float(n), max_norm) if max_norm > 0 else float(n)) / eps
               for n in grad_norms)


def assert_weights_within(want: dict, got: dict, tolerance: float) -> None:
    """`got` has `want`'s tensors, each equal to within `tolerance` (max |difference|); the message names
    the worst tensor."""
    assert want.keys() == got.keys()
    diffs = {k: float((want[k].float() - got[k].float()).abs().max()) for k in want}
    worst = max(diffs, key=diffs.get)
    print(f"weights: worst difference {diffs[worst]:.3g} ({worst}), rounding bound {tolerance:.3g}")
    assert diffs[worst] < tolerance, (f"{worst} differs by {diffs[worst]:.3g}, more than rounding explains "
                                      f"({tolerance:.3g})")
