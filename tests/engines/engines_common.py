"""Shared pieces for the engine tests and the multi-process worker: tiny model, data, step plans."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

VOCAB, SEQ, N_SAMPLES = 128, 10, 12

# Step plans: for each step, the micro-batches (lists of sample indices) of each rank. Rank 1 runs
# fewer real micro-batches than rank 0 in step 0 and more in step 2 (it is padded under ZeRO).
PLAN = [
    {0: [[0], [1, 2]], 1: [[3, 4, 5]]},
    {0: [[6, 7]], 1: [[8], [9]]},
    {0: [[10]], 1: [[11], [0], [5]]},
]
# eps: rounding.py's ADAM_EPS, so that the rounding of other summation orders stays small in the weights
OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-3, "weight_decay": 0.1,
       "lr_scheduler": "cosine_with_min_lr", "warmup_ratio": 0.0, "min_lr_ratio": 0.1, "total_steps": 4,
       "max_norm": 1.6}


_ADAM = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}
_MUON = {"muon_lr": "lr", "muon_momentum": "momentum", "muon_nesterov": "nesterov",
         "muon_ns_steps": "ns_steps"}
_TOP = {"optim": "optim", "lr_scheduler": "lr_scheduler", "warmup_ratio": "lr_warmup_ratio",
        "warmup_steps": "lr_warmup_steps",
        "min_lr_ratio": "min_lr_ratio", "max_norm": "max_norm"}
_DS = ("param_dtype", "adam_offload", "grad_accum_dtype", "zpg", "overlap_comm")


def optimizer(**flat):
    """The optimizer config section (`--optim`, `--adam.*`, `--muon.*`, ...) from flat test keywords
    (lr, betas, eps, weight_decay, muon_lr, ..., lr_scheduler, warmup_ratio, warmup_steps, min_lr_ratio,
    max_norm)."""
    from posttrain.config.sections import AdamConfig, MuonConfig, OptimizerFields

    unknown = set(flat) - set(_ADAM) - set(_MUON) - set(_TOP)
    assert not unknown, unknown
    return OptimizerFields(adam=AdamConfig(**{_ADAM[k]: v for k, v in flat.items() if k in _ADAM}),
                           muon=MuonConfig(**{_MUON[k]: v for k, v in flat.items() if k in _MUON}),
                           **{_TOP[k]: v for k, v in flat.items() if k in _TOP})


def train_engine(model, *, total_steps: int, zero_stage=None, **flat):
    """`make_train_engine` with flat test keywords: optimizer ones and the --ds ones (param_dtype,
    adam_offload, grad_accum_dtype, zpg, overlap_comm)."""
    from posttrain.config.sections import DSConfig
    from posttrain.engines import make_train_engine

    ds = DSConfig(**{"param_dtype": "fp32", **{k: flat.pop(k) for k in _DS if k in flat}})
    return make_train_engine(model, optimizer(**flat), total_steps=total_steps, ds=ds, zero_stage=zero_stage)


def torch_engine(model, *, total_steps: int, param_dtype: str = "fp32", **flat):
    """`TorchEngine` with flat test keywords (see `optimizer`)."""
    from posttrain.engines import TorchEngine

    return TorchEngine(model, optimizer(**flat), total_steps=total_steps, param_dtype=param_dtype)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).float()


def make_data(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (N_SAMPLES, SEQ), generator=g)
    mask = (torch.rand(N_SAMPLES, SEQ, generator=g) < 0.7).long()
    mask[:, 0] = 0
    mask[:, -1] = 1
    return {"input_ids": ids, "loss_mask": mask}


def step_tokens(data: dict, step_plan: dict) -> int:
    """Target tokens of the whole step (all ranks): the token-mean denominator."""
    idx = [i for mbs in step_plan.values() for mb in mbs for i in mb]
    return int(data["loss_mask"][idx, 1:].sum())


def micro_loss(model, data: dict, idx: list[int], total_tokens: int, device="cpu") -> torch.Tensor:
    """sum over the micro-batch's target tokens of CE / total_tokens (so the step loss is a sum)."""
    ids = data["input_ids"][idx].to(device)
    mask = data["loss_mask"][idx].to(device)
    logits = model(input_ids=ids).logits.float()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    return (ce * mask[:, 1:].reshape(-1)).sum() / total_tokens


def run_step(engine, data: dict, step_plan: dict, rank: int, pad: bool) -> float:
    """One optimizer step with this rank's micro-batches, padded to the max count across ranks."""
    total = step_tokens(data, step_plan)
    mbs = step_plan[rank]
    n = engine.max_across_ranks(len(mbs)) if pad else len(mbs)
    for k in range(n):
        if k < len(mbs):
            loss = micro_loss(engine.model, data, mbs[k], total, engine.device)
        else:  # padding: a real forward with zero weight keeps ZeRO's collectives in step
            loss = micro_loss(engine.model, data, [0], total, engine.device) * 0.0
        engine.backward(loss)
    return engine.step()


def merged(step_plan: dict) -> dict:
    """The same step as one process with a single micro-batch."""
    return {0: [[i for mbs in step_plan.values() for mb in mbs for i in mb]]}


def weights(engine) -> dict[str, torch.Tensor]:
    sd = engine.full_state_dict()
    return None if sd is None else {k: v.clone() for k, v in sd.items()}


@pytest.fixture(autouse=False)
def one_thread():
    """Tiny matmuls on a loaded 2-core machine run ~1000x slower with 2 OpenMP threads: use one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
