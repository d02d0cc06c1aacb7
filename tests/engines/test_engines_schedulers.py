"""LR schedules: hand-computed values, through a real engine's ``lr`` and as pure functions, and the same
factors as transformers' ``get_scheduler`` for every schedule it knows."""

import math

import pytest
import torch
from engines_common import one_thread, torch_engine  # noqa: F401

from posttrain.engines import SCHEDULERS, lr_multiplier, num_warmup_steps
from posttrain.engines.schedulers import METRIC_SCHEDULERS, wsd_decay_steps

pytestmark = pytest.mark.usefixtures("one_thread")


def lrs(name, steps=11, **kw):
    model = torch.nn.Linear(2, 2)
    engine = torch_engine(model, lr=1.0, total_steps=10, lr_scheduler=name, **kw)
    out = []
    for _ in range(steps):
        out.append(engine.lr)
        model(torch.ones(1, 2)).sum().mul(0).backward()
        engine.step()
    return out


def test_warmup_steps_is_ceil():
    assert num_warmup_steps(10, 0.03) == 1
    assert num_warmup_steps(100, 0.03) == 3
    assert num_warmup_steps(10, 0.0) == 0


def test_cosine_with_min_lr_hand_values():
    got = lrs("cosine_with_min_lr", warmup_ratio=0.2, min_lr_ratio=0.1)  # 2 warm-up steps, 8 decay steps
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]
    assert got == pytest.approx([0.0, 0.5] + cos)
    assert got[2] == pytest.approx(1.0) and got[6] == pytest.approx(0.55) and got[10] == pytest.approx(0.1)


def test_constant_and_linear_hand_values():
    assert lrs("constant_with_warmup", warmup_ratio=0.2) == pytest.approx([0.0, 0.5] + [1.0] * 9)
    assert lrs("linear", warmup_ratio=0.2) == pytest.approx([0.0, 0.5] + [1 - k / 8 for k in range(9)])


def test_unknown_scheduler_lists_valid_ones():
    with pytest.raises(ValueError) as err:
        lr_multiplier("cosine_restarts", total_steps=10)
    for name in SCHEDULERS:
        assert name in str(err.value)


# --------------------------------------------------------------------------- every transformers schedule
T, W = 10, 2  # total steps, warm-up steps in the hand-computed tables below


def factors(name, total=T, warmup=W, **kw):
    f = lr_multiplier(name, total_steps=total, warmup_steps=warmup, **kw)
    return [f(s) for s in range(total + 1)]


def cos_down(p):
    return 0.5 * (1 + math.cos(math.pi * p))


# (name, kwargs, hand values at s = 0..10 with T = 10, W = 2)
HAND = [
    ("linear", {}, [0, 0.5] + [(10 - s) / 8 for s in range(2, 11)]),
    ("cosine", {}, [0, 0.5] + [cos_down((s - 2) / 8) for s in range(2, 11)]),
    ("cosine_with_restarts", {}, [0, 0.5] + [cos_down((s - 2) / 8) for s in range(2, 10)] + [0.0]),
    # end LR 1e-7 of a peak 1e-3: e = 1e-4; power 1
    ("polynomial", {"peak_lr": 1e-3}, [0, 0.5] + [1e-4 + (1 - 1e-4) * (10 - s) / 8 for s in range(2, 11)]),
    ("constant", {}, [1.0] * 11),
    ("constant_with_warmup", {}, [0, 0.5] + [1.0] * 9),
    ("inverse_sqrt", {}, [0, 0.5] + [math.sqrt(2 / s) for s in range(2, 11)]),
    ("cosine_with_min_lr", {"min_lr_ratio": 0.1},
     [0, 0.5] + [0.1 + 0.9 * cos_down((s - 2) / 8) for s in range(2, 11)]),
    # warm-up one step ahead: (s + 1) / 2; decay p' = (s - 1) / 8 (past 1 at s = T, as transformers)
    ("cosine_warmup_with_min_lr", {"min_lr_ratio": 0.1},
     [0.5, 1.0] + [0.1 + 0.9 * cos_down((s - 1) / 8) for s in range(2, 11)]),
    # d = ceil(10 / 10) = 1 decay step (step 9, q = 0); warm-up from m: 0.1, 0.55
    ("warmup_stable_decay", {"min_lr_ratio": 0.1}, [0.1, 0.55] + [1.0] * 8 + [0.1]),
]


@pytest.mark.parametrize("name, kw, expected", HAND, ids=[h[0] for h in HAND])
def test_every_schedule_by_hand(name, kw, expected):
    assert factors(name, **kw) == pytest.approx(expected, abs=1e-12)


def test_hand_tables_spot_values():
    assert factors("cosine")[6] == pytest.approx(0.5)  # p = 1/2
    assert factors("inverse_sqrt")[8] == pytest.approx(0.5)  # sqrt(2 / 8)
    assert (factors("linear")[6] == 0.5
            and factors("cosine_with_min_lr", min_lr_ratio=0.1)[10] == pytest.approx(0.1))
    # no warm-up: inverse_sqrt's timescale is 10000; wsd over 30 steps decays in the last ceil(30 / 10) = 3
    assert factors("inverse_sqrt", warmup=0)[10] == pytest.approx(math.sqrt(10000 / 10010))
    wsd = factors("warmup_stable_decay", total=30, warmup=0, min_lr_ratio=0.0)
    assert (wsd[26] == 1.0 and wsd[27] == 1.0 and wsd[28] == pytest.approx(0.75)
            and wsd[29] == pytest.approx(0.25))
    assert wsd[30] == 0.0


def _transformers_factors(name, total, warmup, m, peak):
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    extra = {"cosine_with_min_lr": {"min_lr_rate": m}, "cosine_warmup_with_min_lr": {"min_lr_rate": m},
             "warmup_stable_decay": {"min_lr_ratio": m, "num_decay_steps": wsd_decay_steps(total, warmup)}}
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                          scheduler_specific_kwargs=extra.get(name))
    # transformers' polynomial divides by T - w: with w = T its step T is a ZeroDivisionError
    last = total - 1 if name == "polynomial" and total == warmup else total
    return [float(sched.lr_lambdas[0](s)) for s in range(last + 1)]


STEP_SCHEDULES = [n for n in SCHEDULERS if n not in METRIC_SCHEDULERS]


@pytest.mark.parametrize("name", STEP_SCHEDULES)
@pytest.mark.parametrize("total, warmup", [(10, 2), (7, 0), (25, 7), (30, 3), (5, 5), (4, 6), (1, 0)])
def test_same_factors_as_transformers_get_scheduler(name, total, warmup):
    """transformers' own schedule on a dummy optimizer: the same factor at every step 0..T (1e-12)."""
    m, peak = 0.1, 1e-3
    ours = factors(name, total=total, warmup=warmup, min_lr_ratio=m, peak_lr=peak)
    theirs = _transformers_factors(name, total, warmup, m, peak)
    assert ours[:len(theirs)] == pytest.approx(theirs, abs=1e-12, rel=1e-12)
    f = lr_multiplier(name, total_steps=total, warmup_steps=warmup, min_lr_ratio=m, peak_lr=peak)
    assert f(total + 5) == f(total)  # past the end: the value at T


def test_the_list_is_transformers_scheduler_types():
    from transformers.trainer_utils import SchedulerType

    assert set(SCHEDULERS) == {s.value for s in SchedulerType}


@pytest.mark.parametrize("name", sorted(METRIC_SCHEDULERS))
def test_metric_schedules_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="metric"):
        lr_multiplier(name, total_steps=10)


def test_polynomial_needs_a_peak_above_its_end():
    with pytest.raises(ValueError, match="above it"):
        lr_multiplier("polynomial", total_steps=10, peak_lr=1e-7)


def test_warmup_steps_win_over_the_ratio():
    assert num_warmup_steps(25, 0.28) == 8  # float rounding: 25 x 0.28 = 7.000000000000001
    assert num_warmup_steps(25, 0.28, 7) == 7 and num_warmup_steps(25, 0.5, 0) == 0
    # through a real engine: 3 warm-up steps from --lr_warmup_steps, the ratio ignored
    assert lrs("constant_with_warmup", steps=5, warmup_ratio=0.5, warmup_steps=3) == pytest.approx(
        [0, 1 / 3, 2 / 3, 1, 1])


def test_engine_polynomial_reads_the_adam_lr():
    got = lrs("polynomial", warmup_ratio=0.0)  # lr 1.0: end 1e-7
    assert got == pytest.approx([1e-7 + (1 - 1e-7) * (10 - s) / 10 for s in range(11)], abs=1e-12)
