"""Worker for test_context_parallel: a tiny llama's loss and gradients over one packed row (samples of lengths
LENGTHS), computed whole in one process and split over the ranks of the group (context parallel). Two losses:
a sum over tokens (each rank its share) and one every rank computes alike from the row's per-token log-probs
gathered over the group (`gather_replicated`, as RL losses and reward reads). Prints `max_rel_loss=...
max_abs_grad=... max_grad=...` and `replicated: ...` (the same for the second loss) and the bytes moved
on rank 0."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.models import build_tiny, forward_logits, load_causal_lm
from posttrain.models.context_parallel import (
    context_parallel,
    gather_replicated,
    next_tokens,
    register,
    slice_row,
    traffic,
)

LENGTHS = [int(x) for x in os.environ.get("CP_LENGTHS", "5,7,6").split(",")]
STRIDE = int(os.environ.get("CP_STRIDE", "1"))


def row(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = next_tokens(ids, -100)
    # a sample's last token has no label (the next is another sample)
    ends = torch.tensor(LENGTHS).cumsum(0) - 1
    labels[0, ends] = -100
    return ids, pos, labels


def replicated_loss(logits: torch.Tensor, labels: torch.Tensor, length: int, group=None) -> torch.Tensor:
    """A loss that is not a sum over tokens: (Σ_t logp_t / T)² over the row's labelled tokens, read from the
    whole row (gathered when `group` is given)."""
    logp = torch.log_softmax(logits[0], -1).gather(1, labels[0].clamp(min=0)[:, None])[:, 0]
    logp = logp * (labels[0] != -100)
    if group is not None:
        logp = gather_replicated(logp, group)
    return (logp[:length].sum() / length) ** 2


def summed_grads(model, rank):
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[n] = g
    model.zero_grad()
    return grads


def report(label, rank, split_loss, whole_loss, grads, want):
    if rank == 0:
        rel = abs(float(split_loss) - float(whole_loss)) / abs(float(whole_loss))
        diff = max(float((grads[n] - want[n]).abs().max()) for n in want)
        scale = max(float(want[n].abs().max()) for n in want)
        print(f"{label}max_rel_loss={rel:.3g} max_abs_grad={diff:.3g} max_grad={scale:.3g}", flush=True)


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    path = sys.argv[1]
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        build_tiny(path, arch="llama", size="nano", seed=0, verbose=False)
    dist.barrier()
    model = load_causal_lm(path, "fp32", onednn_linear=False)
    ids, pos, labels = row(model.config.vocab_size)
    # whole, in one process (every rank computes it): posttrain's packed forward (block-causal mask)
    logits = forward_logits(model, {"input_ids": ids, "position_ids": pos})
    whole_loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
    whole_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    whole_rep = replicated_loss(forward_logits(model, {"input_ids": ids, "position_ids": pos}), labels,
                                ids.shape[1])
    whole_rep.backward()
    want_rep = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # split over the group
    name = register()
    model.set_attn_implementation(name)
    local_ids, local_pos = slice_row(ids, rank, size, 0), slice_row(pos, rank, size, 0)
    local_labels = slice_row(labels, rank, size, -100)
    valid = slice_row(torch.ones_like(ids, dtype=torch.bool), rank, size, False)
    with context_parallel(None, local_pos, valid, head_stride=STRIDE):
        out = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits.float()
    loss = F.cross_entropy(out[0], local_labels[0], ignore_index=-100, reduction="sum")
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    report("", rank, total, whole_loss, summed_grads(model, rank), want)
    traffic(reset=True)
    with context_parallel(None, local_pos, valid, head_stride=STRIDE):
        out = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits.float()
    rep = replicated_loss(out, local_labels, ids.shape[1], group=dist.group.WORLD)
    rep.backward()
    report("replicated: ", rank, rep.detach(), whole_rep, summed_grads(model, rank), want_rep)
    moved = traffic()
    if rank == 0:
        print(f"moved bytes={moved['bytes']} seconds={moved['seconds']:.3g}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
