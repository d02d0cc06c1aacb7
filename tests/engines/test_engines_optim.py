"""Optimizer grouping, weight-decay exemption and Muon."""

import pytest
import torch
from engines_common import (
    one_thread,  # noqa: F401
    optimizer,
    tiny_llama,
    torch_engine,
)
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread")
from posttrain.engines import MuonAdamW, param_groups, param_roles
from posttrain.engines.optim import newton_schulz


def test_weight_decay_exempts_1d_params():
    model = tiny_llama(0)
    roles = param_roles(model, "adam")
    assert roles["no_decay"] and all(p.ndim == 1 for _, p in roles["no_decay"])
    assert {n for n, _ in roles["no_decay"]} == {n for n, p in model.named_parameters() if p.ndim == 1}
    assert not roles["muon"]
    # Effect: a zero-gradient AdamW step only decays: 2-D params shrink by (1 - lr*wd), 1-D stay.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = torch_engine(model, lr=0.1, weight_decay=0.5, warmup_ratio=0.0, total_steps=5)
    model(input_ids=torch.ones(1, 3, dtype=torch.long)).logits.sum().mul(0).backward()
    engine.step()
    for n, p in model.named_parameters():
        factor = 1.0 if p.ndim == 1 else 1 - 0.1 * 0.5
        torch.testing.assert_close(p.detach(), before[n] * factor, rtol=0, atol=1e-7, msg=n)


def test_muon_group_holds_only_hidden_matrices():
    model = tiny_llama(0)
    groups = {g["name"]: g for g in param_groups(model, optimizer(optim="muon", lr=1e-3, muon_lr=0.02))}
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for p in groups["muon"]["params"])
    expected = sorted(f"model.layers.{i}.{m}.weight" for i in range(2) for m in
                      ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))
    assert muon == expected
    aux = {names[id(p)] for k in ("decay", "no_decay") for p in groups[k]["params"]}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= aux
    assert groups["muon"]["lr"] == 0.02 and groups["decay"]["lr"] == 1e-3


def test_value_head_goes_to_aux_adam():
    model = nn.ModuleDict({"body": nn.Linear(4, 4), "value_head": nn.Linear(4, 4), "out": nn.Linear(4, 1)})
    roles = param_roles(model, "muon")
    assert [n for n, _ in roles["muon"]] == ["body.weight"]
    assert {n for n, _ in roles["decay"]} == {"value_head.weight", "out.weight"}


def test_newton_schulz_orthogonalizes():
    g = torch.randn(16, 24, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.6 and s.max() < 1.3
    u, _, vh = torch.linalg.svd(g, full_matrices=False)  # same singular vectors as G: U^T NS(G) V diagonal
    m = u.T @ newton_schulz(g) @ vh.T
    assert (m - torch.diag(m.diagonal())).abs().max() < 1e-4


def test_muon_first_step_and_aux_adam_match_hand_and_torch():
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(6, 3)), nn.Parameter(torch.randn(6))
    w_ref, b_ref = w.detach().clone(), nn.Parameter(b.detach().clone())
    opt = MuonAdamW([{"params": [w], "use_muon": True, "lr": 0.05, "momentum": 0.9, "nesterov": True,
                      "ns_steps": 5, "weight_decay": 0.0},
                     {"params": [b], "use_muon": False, "lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8,
                      "weight_decay": 0.0}])
    adamw = torch.optim.AdamW([b_ref], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    x = torch.randn(5, 3)
    for step in range(3):
        (torch.tanh(x @ w.T + b) ** 2).sum().backward()
        g = w.grad.clone()
        b_ref.grad = b.grad.clone()
        opt.step()
        adamw.step()
        if step == 0:  # momentum and nesterov only rescale G on the first step: NS is scale-invariant
            expected = w_ref - 0.05 * (6 / 3) ** 0.5 * newton_schulz(g)
            torch.testing.assert_close(w.detach(), expected, atol=1e-6, rtol=0)
        torch.testing.assert_close(b.detach(), b_ref.detach(), atol=1e-7, rtol=0)
        opt.zero_grad()
        adamw.zero_grad()


def test_muon_keeps_aux_lr_and_reduces_regression_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    x = torch.randn(64, 8)
    y = torch.sin(x.sum(1, keepdim=True))
    engine = torch_engine(model, optim="muon", lr=1e-2, muon_lr=0.05, warmup_ratio=0.1, total_steps=60,
                         max_norm=0.0)
    groups = {g["name"]: g for g in engine.optimizer.param_groups}
    assert len(groups["muon"]["params"]) == 2  # the two hidden matrices; the 32->1 head is aux
    losses = []
    for _ in range(60):
        loss = ((model(x) - y) ** 2).mean()
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
        assert groups["muon"]["lr"] == pytest.approx(groups["decay"]["lr"] * 0.05 / 1e-2)
    assert engine.lr == pytest.approx(groups["decay"]["lr"])
    assert losses[-1] < 0.3 * losses[0]


def test_unknown_optimizer():
    with pytest.raises(ValueError, match="adam, muon"):
        param_roles(nn.Linear(2, 2), "sgd")
