"""ZeRO-3 optimizer step without the two extra copies DeepSpeed 0.19 makes of a rank's partition.

DeepSpeed's ZeRO-3 optimizer holds, per rank: the parameter partitions (in one flat buffer, the
"low-precision" groups), an fp32 master copy of them that the torch optimizer steps, the reduced gradient
partitions (another flat buffer) and the optimizer state. ``lean_step(optimizer)`` removes two copies
that hold nothing new when the parameters are already in the master dtype and nothing is offloaded
(fp32 training, the CPU case):

- ``share_master_weights``: the master partition becomes a view of the parameter partition. DeepSpeed
  means to do this itself ("we don't need another copy of the weights", ``_create_fp32_partitions``) but
  compares ``tensor.device`` with a device *name* (``torch.device("cpu") == "cpu"`` is False), so it
  always clones. Its step then updates the parameters in place, and its copy from master to parameters
  after the step copies a buffer onto itself.
- ``share_flat_gradients``: just before a sub-group's step DeepSpeed flattens that sub-group's gradients
  into a new tensor (``_prepare_fp32_grad_for_sub_group``); with the default ``sub_group_size`` (1e9
  elements, one sub-group below 1B parameters per rank) that is a second copy of the whole gradient
  partition, alive at the step's peak. The master gets a view of the gradient buffer instead when the
  sub-group's gradients lie there in order, in the master's dtype, and the view is zeroed once the
  sub-group has stepped. DeepSpeed never clears that buffer: the first backward of a step overwrites
  the slots of the parameters that get a gradient, so a parameter without one in a step (not used by
  its forwards, an expert no token was routed to) stepped again with its last gradient, and one first
  used after the first micro-batch added to it. Zeroed, such a parameter steps with a zero gradient
  and accumulates from zero.

Where a condition does not hold (other dtypes, offload, other DeepSpeed internals) DeepSpeed's own
behaviour stays. When every trained parameter gets a gradient in the first micro-batch of each step
the weights are bit-identical either way (``tests/engines/test_zero3_step.py``).
"""

from __future__ import annotations

import torch


def lean_step(optimizer) -> None:
    """Both changes (module docstring) on a DeepSpeed ZeRO-3 optimizer, each where its conditions hold."""
    share_master_weights(optimizer)
    share_flat_gradients(optimizer)


def _in_memory(optimizer) -> bool:
    """A ZeRO-3 optimizer of the expected shape whose partitions all stay in this device's memory."""
    return (not getattr(optimizer, "offload_optimizer", True)
            and not getattr(optimizer, "swap_optimizer", False)
            and hasattr(optimizer, "fp16_partitioned_groups_flat")
            and hasattr(optimizer, "fp32_partitioned_groups_flat"))


def share_master_weights(optimizer) -> int:
    """Make each fp32 master partition a view of its parameter partition where both have the same dtype,
    device and shape and hold equal values; returns how many sub-groups now share."""
    if not _in_memory(optimizer):
        return 0
    shared = 0
    for low, master in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
        if (low is None or low.dtype != master.dtype or low.device != master.device
            or low.shape != master.shape):
            continue
        if low.data_ptr() != master.data_ptr():
            if not torch.equal(low, master):
                continue
            master.data = low.data  # the same tensor object: the optimizer's param groups and state keep it
        shared += 1
    return shared


def adjacent_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view over `tensors` when they are contiguous views of the same base, each starting where the
    previous one ends; else None."""
    if not tensors:
        return None
    base = tensors[0]._base
    if base is None or not base.is_contiguous():
        return None
    start = tensors[0].storage_offset()
    end = start
    for t in tensors:
        if t._base is not base or not t.is_contiguous() or t.storage_offset() != end:
            return None
        end += t.numel()
    return base.view(-1).narrow(0, start - base.storage_offset(), end - start)


def share_flat_gradients(optimizer) -> bool:
    """Hand each sub-group its gradient as a view of the flat gradient buffer (module docstring); returns
    whether it was installed."""
    prepare = getattr(optimizer, "_prepare_fp32_grad_for_sub_group", None)
    if (prepare is None or not hasattr(optimizer, "_release_sub_group") or not _in_memory(optimizer)
            or not hasattr(optimizer, "averaged_gradients")):
        return False

    release = optimizer._release_sub_group
    handed: dict[int, torch.Tensor] = {}  # sub-group -> the buffer view its step reads

    def prepare_as_view(sub_group_id: int) -> None:
        master = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        grad = adjacent_view(optimizer.averaged_gradients[sub_group_id])
        if (grad is None or grad.dtype != master.dtype or grad.numel() != master.numel()
            or grad.device != master.device):
            prepare(sub_group_id)
            return
        master.grad = handed[sub_group_id] = grad
        optimizer.averaged_gradients[sub_group_id] = None

    def release_cleared(sub_group_id: int, *args, **kwargs):
        grad = handed.pop(sub_group_id, None)
        if grad is not None:  # stepped: the next step starts from zero (module docstring)
            grad.zero_()
        return release(sub_group_id, *args, **kwargs)

    optimizer._prepare_fp32_grad_for_sub_group = prepare_as_view
    optimizer._release_sub_group = release_cleared
    return True
