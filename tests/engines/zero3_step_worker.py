"""Worker for test_zero3_step: one process, ZeRO-3 engines over a tiny llama trained for 3 steps of
1-2 micro-batches (with clipping and weight decay), with and without `lean_step`, at DeepSpeed's default
sub-group size and at one that splits the model into several sub-groups. Prints one line per run: whether
every master partition the optimizer stepped was a view of the parameter partitions and its gradient a
view of the flat gradient buffer, and the sub-group count; then whether both runs of each sub-group size ended bit-identical.
"""
import os

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

os.environ.setdefault("DS_BUILD_OPS", "0")
from engines_common import PLAN, make_data, run_step, tiny_llama, train_engine, weights  # noqa: E402

import posttrain.engines.deepspeed_engine as ds_engine  # noqa: E402

SUB_GROUP = {"default": None, "split": 3000}
make, lean_step = ds_engine.ds_config, ds_engine.lean_step


def train(lean: bool, sub_group: int | None) -> tuple[bool, bool, int, dict]:
    def config(**kwargs):
        cfg = make(**kwargs)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every parameter
        if sub_group:
            cfg["zero_optimization"]["sub_group_size"] = sub_group
        return cfg

    ds_engine.ds_config = config
    ds_engine.lean_step = lean_step if lean else (lambda optimizer: {})
    engine = train_engine(tiny_llama(0), total_steps=4, zero_stage=3, lr=1e-2, max_norm=0.5, weight_decay=0.1)
    zero = engine.engine.optimizer
    params = zero.fp16_partitioned_groups_flat[0].untyped_storage().data_ptr()
    grads = zero.grad_partitions_flat_buffer.untyped_storage().data_ptr()
    masters, views = [], []

    def record(optimizer, _args, _kwargs):
        for p in (p for g in optimizer.param_groups for p in g["params"] if p.grad is not None):
            masters.append(p.untyped_storage().data_ptr() == params)
            views.append(p.grad.untyped_storage().data_ptr() == grads)

    handle = register_optimizer_step_pre_hook(record)
    data = make_data()
    for step_plan in PLAN:
        run_step(engine, data, {0: step_plan[0] + step_plan[1]}, 0, pad=False)
    handle.remove()
    return all(masters) and bool(masters), all(views) and bool(views), len(zero.fp16_groups), weights(engine)


def main() -> None:
    torch.set_num_threads(1)
    for name, sub_group in SUB_GROUP.items():
        runs = {lean: train(lean, sub_group) for lean in (True, False)}
        for lean, (masters, views, groups, _) in runs.items():
            print(f"{name} lean={lean} masters={masters} grads={views} groups={groups}", flush=True)
        same = all(torch.equal(runs[True][3][k], runs[False][3][k]) for k in runs[True][3])
        print(f"{name} identical={same}", flush=True)


if __name__ == "__main__":
    main()
