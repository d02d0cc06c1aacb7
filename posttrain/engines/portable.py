"""A layout-free copy of a train engine's state, so a checkpoint written on N ranks at one ZeRO stage resumes
on M ranks at another (or in one process).

Files (rank 0 writes them; every rank reads them): `portable.safetensors` holds, for every trainable parameter
`name`, its whole fp32 value `weight/name` and, once the optimizer has stepped, Adam's moments `exp_avg/name`
and `exp_avg_sq/name`; `portable.json` holds Adam's step count `t` (bias correction), the scheduler's state
and the engine's step counter, the optimizer's current learning rates. Reading and writing go through
DeepSpeed's `safe_get/set_full_*` accessors under ZeRO 1-3 (collective under ZeRO-3: every rank takes part)
and through the parameters and the torch optimizer's state otherwise (one process, ZeRO-0)."""
from __future__ import annotations

import contextlib
import json
import os

import torch

WEIGHTS, META = "portable.safetensors", "portable.json"


def _inner_optimizer(engine):
    """The torch optimizer under DeepSpeed's wrappers."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def uses_adam(engine) -> bool:
    """The engine steps with Adam(W) alone (the copy holds Adam's moments; Muon keeps other state)."""
    return "Muon" not in type(_inner_optimizer(engine)).__name__


def _zero(engine) -> int:
    return getattr(engine, "zero_stage", None) or 0


def _trainable(engine):
    return [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]


def _adam_step(engine) -> int:
    """Adam's step count t (the same for every parameter)."""
    for state in _inner_optimizer(engine).state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def _full(engine, param) -> dict[str, torch.Tensor]:
    """`weight` (and the moments once they exist) of one parameter, whole, fp32, on CPU;
    collective under ZeRO-3."""
    if _zero(engine) >= 1:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        out = {"weight": safe_get_full_fp32_param(param)}
        if _adam_step(engine):
            out.update(exp_avg=safe_get_full_optimizer_state(param, "exp_avg"),
                       exp_avg_sq=safe_get_full_optimizer_state(param, "exp_avg_sq"))
    else:
        state = _inner_optimizer(engine).state.get(param, {})
        out = {"weight": param.detach(), **{k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state}}
    return {k: v.detach().float().cpu().clone() for k, v in out.items() if v is not None}


def _relink(engine) -> None:
    """ZeRO 1/2: point every parameter's view at its group's Adam state again. DeepSpeed links the views once,
    after the first group's first step, when the later groups (e.g. the no-decay one) have no state yet."""
    optimizer = engine.engine.optimizer if _zero(engine) in (1, 2) else None
    if optimizer is not None and hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def save_portable(engine, directory: str) -> None:
    """Write the portable state of `engine` into `directory` (every rank calls it; rank 0 writes)."""
    from safetensors.torch import save_file

    if _adam_step(engine):
        _relink(engine)
    tensors = {}
    for name, param in _trainable(engine):
        for kind, value in _full(engine, param).items():
            tensors[f"{kind}/{name}"] = value
    if engine.is_main:
        save_file(tensors, os.path.join(directory, WEIGHTS))
        meta = {"adam_step": _adam_step(engine), "scheduler": engine.scheduler.state_dict(),
                "lrs": [g["lr"] for g in _inner_optimizer(engine).param_groups],
                "global_step": engine.global_step}
        with open(os.path.join(directory, META), "w") as f:
            json.dump(meta, f, indent=1, default=float)
    engine.barrier()


def has_portable(directory: str) -> bool:
    return all(os.path.isfile(os.path.join(directory, f)) for f in (WEIGHTS, META))


def _optimized_tensors(engine) -> list[torch.Tensor]:
    """The tensors the torch optimizer keeps Adam's state for: ZeRO 1/2 and 3 hand it flat fp32 partitions
    (ZeRO-3 only while it steps), otherwise the parameters themselves."""
    wrapper, stage = getattr(getattr(engine, "engine", None), "optimizer", None), _zero(engine)
    if stage in (1, 2):
        return list(wrapper.single_partition_of_fp32_groups)
    if stage == 3:
        return [t for t in wrapper.fp32_partitioned_groups_flat if t is not None]
    return [p for group in _inner_optimizer(engine).param_groups for p in group["params"]]


def _start_moments(engine, step: int) -> None:
    """Adam's state for every tensor the torch optimizer steps, at `step`: DeepSpeed creates it at the first
    step only, and its accessors need it to exist."""
    opt = _inner_optimizer(engine)
    for p in _optimized_tensors(engine):
        state = opt.state[p]
        if "exp_avg" not in state:
            state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] = torch.tensor(float(step))
    _relink(engine)


def load_portable(engine, directory: str) -> dict:
    """Load the portable state in `directory` into `engine` (every rank calls it); returns its meta."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(directory, WEIGHTS))
    with open(os.path.join(directory, META)) as f:
        meta = json.load(f)
    names = {n for n, _ in _trainable(engine)}
    saved = {k.split("/", 1)[1] for k in tensors if k.startswith("weight/")}
    if saved != names:
        diff = sorted(saved ^ names)[:3]
        raise ValueError(f"{directory}/{WEIGHTS} holds other trainable parameters than the model's (e.g. "
                         f"{diff})")
    step = int(meta["adam_step"])
    if step:
        _start_moments(engine, step)
    for name, param in _trainable(engine):
        _set(engine, param, {k: tensors[f"{k}/{name}"] for k in ("weight", "exp_avg", "exp_avg_sq")
                             if f"{k}/{name}" in tensors})
    # (it does not set the optimizer's rates: they follow)
    engine.scheduler.load_state_dict(meta["scheduler"])
    for group, lr in zip(_inner_optimizer(engine).param_groups, meta["lrs"]):
        group["lr"] = lr
    engine.set_global_step(int(meta["global_step"]))
    return meta


def _writable(param):
    """ZeRO-3: the whole parameter, written back to every rank's partition on exit (collective)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=0)


def _set(engine, param, values: dict[str, torch.Tensor]) -> None:
    stage = _zero(engine)
    if stage >= 1:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        safe_set_full_fp32_param(param, values["weight"].to(param.device))
        for key in ("exp_avg", "exp_avg_sq"):
            if key in values:
                safe_set_full_optimizer_state(param, values[key].to(param.device), key)
        # the module's own (low-precision) copy: whole on every rank under ZeRO 1/2,
        # re-partitioned under ZeRO-3
        with _writable(param) if stage == 3 else contextlib.nullcontext(), torch.no_grad():
            param.copy_(values["weight"].to(param.device, param.dtype))
        return
    with torch.no_grad():
        param.copy_(values["weight"].to(param.dtype))
    state = _inner_optimizer(engine).state[param]
    for key in ("exp_avg", "exp_avg_sq"):
        if key in values:
            state[key] = values[key].to(param.device, torch.float32).clone()
