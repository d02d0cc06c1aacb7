"""LR schedules: hand-computed values through a real engine's ``lr``."""

import math

import pytest
import torch
from engines_common import one_thread, torch_engine  # noqa: F401

from posttrain.engines import SCHEDULERS, lr_multiplier, num_warmup_steps

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
