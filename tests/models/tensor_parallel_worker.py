"""Worker for test_tensor_parallel_model: a tiny model (ARCH: llama, or qwen2 with q/k/v biases; both GQA: 4
heads, 2 key/value heads; UNTIED 1: its own lm_head) run whole in one process and split over the 2 ranks of a
tensor-parallel group (DeepSpeed AutoTP, ZeRO-0), for each case of TP_CASES ("ARCH:UNTIED;...", one launch
for all; each case builds its model into its own folder under argv[1]). Prints on rank 0, after a
`case ARCH:UNTIED` line, `max_rel_logits=... max_rel_grad=... rel_norm=... own=... split=... full=... opt=...
max_rel_export=...`: logits, gathered gradients, the global gradient norm, this rank's parameter / split /
whole-model / optimizer-state elements and the gathered weights after one step against the unsplit model's
after the same AdamW step."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from posttrain.config.sections import AdamConfig, DSConfig, OptimizerFields
from posttrain.engines import make_train_engine
from posttrain.engines.dist import shutdown
from posttrain.models import build_tiny, load_causal_lm
from posttrain.models import tensor_parallel as tp

CASES = os.environ.get("TP_CASES", "llama:0").split(";")


def batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def loss_of(logits, b):
    labels = b["input_ids"][:, 1:].masked_fill(b["attention_mask"][:, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main():
    dist.init_process_group("gloo")
    for case in CASES:
        arch, untied = case.split(":")
        if dist.get_rank() == 0:
            print(f"case {case}", flush=True)
        one_case(os.path.join(sys.argv[1], f"{arch}-{untied}"), arch, untied == "1")
    shutdown()  # no gloo thread left alive at exit (an exit-time abort otherwise)


def one_case(path: str, arch: str, untied: bool) -> None:
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        build_tiny(path, arch=arch, size="nano", seed=0, verbose=False)
        if untied:  # a head of its own (AutoTP splits it column-wise and gathers the logits)
            m = load_causal_lm(path, "fp32", onednn_linear=False)
            m.config.tie_word_embeddings = False
            m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach() * 0.5 + 0.01)
            m.save_pretrained(path)
    dist.barrier()
    whole = load_causal_lm(path, "fp32", onednn_linear=False)
    b = batch(whole.config.vocab_size)
    want_logits = whole(**b).logits.float()
    loss_of(want_logits, b).backward()
    want = {n: p.grad.clone() for n, p in whole.named_parameters()}
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()])
    full = sum(p.numel() for p in whole.parameters())
    # eps 1: a step proportional to the gradient (a first Adam step is its sign, which rounding flips near 0)
    opt = OptimizerFields(adam=AdamConfig(lr=1e-2, eps=1.0), max_norm=1e9, lr_scheduler="constant",
                          lr_warmup_ratio=0.0)
    a = opt.adam
    torch.optim.AdamW(whole.parameters(), lr=a.lr, betas=tuple(a.betas), eps=a.eps, weight_decay=0.0).step()

    model = load_causal_lm(path, "fp32", onednn_linear=False)
    engine = make_train_engine(model, opt, total_steps=1, ds=DSConfig(param_dtype="fp32"), zero_stage=0,
                               tensor_parallel=2)
    logits = engine.model(**b).logits.float()
    engine.backward(loss_of(logits, b))
    module = engine.module
    params = dict(module.named_parameters())
    grads = {n: tp.full_tensor(module, n, p, p.grad) for n, p in params.items()}
    norm = tp.grad_norm(list(params.values()), engine.tensor_group)
    own, split = tp.elements(module)
    engine.step()
    opt_elements = tp.optimizer_elements(engine.optimizer)
    export = engine.full_state_dict()
    assert grads.keys() <= want.keys(), set(grads) ^ set(want)
    max_grad = max(rel(grads[n], want[n]) for n in grads)
    if dist.get_rank() == 0:
        state = whole.state_dict()
        assert export.keys() == state.keys(), set(export) ^ set(state)
        max_export = max(rel(export[n], state[n]) for n in state)
        print(f"max_rel_logits={rel(logits, want_logits):.3g} max_rel_grad={max_grad:.3g} "
              f"rel_norm={rel(norm, want_norm):.3g} own={own} split={split} full={full} opt={opt_elements} "
              f"max_rel_export={max_export:.3g}", flush=True)


if __name__ == "__main__":
    main()
