"""Worker for test_zero3_step: one process, ZeRO-3 engines over a tiny llama trained for 3 steps of
1-2 micro-batches (with clipping and weight decay), with and without `lean_step`, at DeepSpeed's default
sub-group size and at one that splits the model into several sub-groups. Prints one line per run: whether
every master partition the optimizer stepped was a view of the parameter partitions and its gradient a
view of the flat gradient buffer, and the sub-group count; then whether both runs of each sub-group size ended
bit-identical. Last, with and without `lean_step`: the largest |gradient| in the input embedding's slot when
the optimizer stepped in a step whose forward did not use the embedding (it was fed `inputs_embeds`).
"""
import os

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

os.environ.setdefault("DS_BUILD_OPS", "0")
from engines_common import PLAN, make_data, run_step, tiny_llama, train_engine, weights  # noqa: E402

import posttrain.engines.deepspeed_engine as ds_engine  # noqa: E402
from posttrain.engines.dist import shutdown

SUB_GROUP = {"default": None, "split": 3000}
make, lean_step = ds_engine.ds_config, ds_engine.lean_step


def zero3_engine(lean: bool, sub_group: int | None = None):
    def config(**kwargs):
        cfg = make(**kwargs)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every parameter
        if sub_group:
            cfg["zero_optimization"]["sub_group_size"] = sub_group
        return cfg

    ds_engine.ds_config = config
    ds_engine.lean_step = lean_step if lean else (lambda optimizer: None)
    return train_engine(tiny_llama(0), total_steps=4, zero_stage=3, lr=1e-2, max_norm=0.5, weight_decay=0.1)


def train(lean: bool, sub_group: int | None) -> tuple[bool, bool, int, dict]:
    engine = zero3_engine(lean, sub_group)
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


def unused_parameter_gradient(lean: bool) -> float:
    """Step 1 trains every parameter; step 2's forward takes `inputs_embeds`, so the input embedding gets no
    gradient: the largest |value| in its gradient slot when step 2's optimizer step ran."""
    engine = zero3_engine(lean)
    zero, embed = engine.engine.optimizer, engine.module.model.embed_tokens.weight
    slots = {}  # master partition -> (offset, size) of the embedding's gradient in it
    for group, master in zip(zero.fp16_groups, zero.fp32_partitioned_groups_flat):
        offsets = [0]
        for p in group:
            if p is embed:
                slots[id(master)] = (offsets[-1], p.partition_numel())
            offsets.append(offsets[-1] + p.partition_numel())
    seen = []

    def record(optimizer, _args, _kwargs):
        seen.extend(float(p.grad.narrow(0, *slots[id(p)]).abs().max()) for g in optimizer.param_groups
                    for p in g["params"] if p.grad is not None and id(p) in slots)

    data = make_data()
    run_step(engine, data, {0: [[0, 1]]}, 0, pad=False)
    handle = register_optimizer_step_pre_hook(record)
    embeds = torch.randn(2, data["input_ids"].shape[1], 32,
                         generator=torch.Generator().manual_seed(0)).to(engine.device)
    engine.backward(engine.model(inputs_embeds=embeds).logits.float().logsumexp(-1).mean())
    engine.step()
    handle.remove()
    return seen[-1]


def main() -> None:
    torch.set_num_threads(1)
    for name, sub_group in SUB_GROUP.items():
        runs = {lean: train(lean, sub_group) for lean in (True, False)}
        for lean, (masters, views, groups, _) in runs.items():
            print(f"{name} lean={lean} masters={masters} grads={views} groups={groups}", flush=True)
        same = all(torch.equal(runs[True][3][k], runs[False][3][k]) for k in runs[True][3])
        print(f"{name} identical={same}", flush=True)
    for lean in (True, False):
        print(f"unused lean={lean} gradient={unused_parameter_gradient(lean):.6g}", flush=True)


if __name__ == "__main__":
    main()
    shutdown()  # no gloo thread left alive at exit (an exit-time abort otherwise)
