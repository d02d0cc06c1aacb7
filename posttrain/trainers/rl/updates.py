"""Policy and critic updates over one rollout batch: `max_epochs` passes, each split into
optimizer steps of `train.batch_size` samples and micro-batches (`Batching`: a sample count, or
a token budget with --train.dynamic_batch_enable; packed rows with --ds.packing_samples).
Every kept sample trains: the last optimizer step of a pass takes the remainder when the rollout
is not a multiple of the batch size (e.g. after dynamic filtering). Every loss is aggregated with
its optimizer step's own token / sequence counts, so the gradient does not depend on the
micro-batch split (docs/algorithms.md, "Loss aggregation")."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from posttrain.algorithms.kl import approx_kl
from posttrain.algorithms.losses import aggregate, policy_loss, value_loss
from posttrain.models.context_parallel import traffic as cp_traffic
from posttrain.models.moe import take_router_loss
from posttrain.trainers.rl.batch_forward import Batching, policy_forward, to_device
from posttrain.trainers.rl.experience import Experience


@dataclass
class UpdateSettings:
    batch_size: int
    batching: Batching
    max_epochs: int
    loss_agg: str  # the KL-loss, entropy and value-loss terms
    max_len: int  # the constant normaliser of seq_sum_norm: the largest generation budget
    eps_low: float
    eps_high: float
    dual_clip: float | None
    policy_loss_type: str
    entropy_coef: float | None
    kl_use_loss: bool
    kl_estimator: str
    is_correction: str | None
    is_threshold: tuple[float, float]
    value_clip: float | None
    seed: int
    policy_loss_agg: str | None = None  # the policy term (None: loss_agg); GSPO's auto default differs
    kl_clamp: float | None = 10.0  # bound of the per-token KL estimate; None: unbounded
    router_loss_coef: float = 0.0  # the MoE router loss's coefficient (actor and critic, as OpenRLHF)

    @property
    def policy_agg(self) -> str:
        return self.policy_loss_agg or self.loss_agg


def lockstep(engine, micro_batches: list[list[int]]) -> list[list[int]]:
    """`micro_batches` padded with empty ones up to the most any rank of `engine` runs (a caller
    computes an empty one on a stand-in row and weights it zero): ZeRO-3 gathers parameters in
    every forward, so ranks must run the same number. Unchanged in one process."""
    if engine is None:
        return micro_batches
    most = engine.max_across_ranks(len(micro_batches))
    return micro_batches + [[] for _ in range(most - len(micro_batches))]


def steps_per_rollout(n: int, batch_size: int, max_epochs: int) -> int:
    """Optimizer steps over a rollout of `n` samples: ceil(n / batch_size) per pass."""
    return max_epochs * math.ceil(n / batch_size)


def optimizer_steps(n: int, s: UpdateSettings, step: int):
    """Row groups of each optimizer step over `max_epochs` shuffled passes (deterministic in step);
    the last group of a pass holds the remainder, so every row trains once per pass."""
    rng = np.random.default_rng([s.seed, step])
    for _ in range(s.max_epochs):
        order = rng.permutation(n)
        for start in range(0, n, s.batch_size):
            yield order[start:start + s.batch_size]


class _Mean:
    def __init__(self) -> None:
        self.sums = defaultdict(float)
        self.weights = defaultdict(float)

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        self.sums[name] += float(value) * weight
        self.weights[name] += weight

    def result(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/{k}": self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


def _micro_batches(batch: Experience, batches: Batching, engine, device):
    """The micro-batches of `batch`, padded in lockstep across ranks (`lockstep`); a padding
    micro-batch is a stand-in row with an all-zero action mask, so its loss and gradient are zero."""
    for rows in lockstep(engine, batches.micro_batches(batch) if len(batch) else []):
        if rows:
            yield to_device(batch.select(rows), device)
        else:
            yield to_device(_stand_in(batch), device)


def _stand_in(batch: Experience) -> Experience:
    part = batch.select([0])
    part.action_mask = torch.zeros_like(part.action_mask)
    return part


def _counts(exp: Experience, engine, context=None) -> tuple[float, float]:
    """Action tokens and sequences of one optimizer step, summed over the data-parallel ranks (each
    holds a share of the step's rows), so every loss is normalised by the whole step's counts. The ranks
    of a context- or tensor-parallel group hold the same rows: counted once."""
    counts = torch.tensor([float(exp.action_mask.sum()), float((exp.action_mask.sum(1) > 0).sum())],
                          dtype=torch.float64)
    engine.all_reduce(counts)
    counts /= (context.size if context is not None else 1) * getattr(engine, "tensor_parallel", 1)
    return float(counts[0]), float(counts[1])


def local_steps(exp: Experience, s: UpdateSettings, step: int, step_rows=None):
    """The rows of each optimizer step this rank trains: `step_rows` (a data-parallel rank's share,
    planned by the controller; possibly empty) or all of `optimizer_steps`. With shared prefixes a step's
    rows are taken in experience order (group-contiguous), so a micro-batch holds the samples of a prompt
    together: the step's gradient is a sum over its rows whatever their micro-batch, so only float
    rounding changes."""
    steps = step_rows if step_rows is not None else optimizer_steps(len(exp), s, step)
    if not s.batching.shared_prefix:
        return steps
    return (sorted(int(r) for r in rows) for rows in steps)


def update_actor(actor, exp: Experience, s: UpdateSettings, kl_coef: float, step: int,
                 step_rows=None, weights_out: dict | None = None) -> dict[str, float]:
    """The policy update of `roles.Actor.fit` (`actor`: its `engine`, `device`, `temperature`,
    `update_ema`). `step_rows`: this rank's rows of each optimizer step (`local_steps`);
    `weights_out` receives each metric's weight (its tokens), so ranks' means merge exactly."""
    mean = _Mean()
    rollout_gap = _Mean()
    engine = actor.engine
    for rows in local_steps(exp, s, step, step_rows):
        batch = exp.select(rows) if len(rows) else _stand_in(exp)
        num_tokens, num_seqs = _counts(batch, engine, actor.context)
        step_loss = 0.0
        for mb in _micro_batches(batch, s.batching, engine, actor.device):
            want_entropy = s.entropy_coef is not None
            logp, ent = policy_forward(engine.model, mb, actor.temperature, with_entropy=want_entropy,
                                      context=actor.context, **s.batching.layout)
            mask = mb.action_mask
            old_logp = mb.old_logp
            if old_logp is None:  # one update per rollout: the sampling policy is this one (ratio 1)
                old_logp = logp.detach()
                gap = ((old_logp - mb.rollout_logp).abs() * mask).sum()
                rollout_gap.add("logprob_abs_gap", float(gap) / max(float(mask.sum()), 1.0),
                                float(mask.sum()))
            loss, m = policy_loss(
                logp, old_logp, mb.advantages, mask, eps_low=s.eps_low, eps_high=s.eps_high,
                dual_clip=s.dual_clip, loss_type=s.policy_loss_type,
                rollout_logp=mb.rollout_logp if s.is_correction else None, is_correction=s.is_correction,
                is_threshold=s.is_threshold, agg=s.policy_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                max_len=s.max_len)
            tokens = float(mask.sum())
            if s.kl_use_loss and mb.ref_logp is not None:
                kl = approx_kl(logp, mb.ref_logp, s.kl_estimator, clamp=s.kl_clamp)
                loss = (loss + kl_coef * aggregate(kl, mask, s.loss_agg, num_tokens=num_tokens,
                                                   num_seqs=num_seqs, max_len=s.max_len))
                mean.add("kl_loss", float((kl.detach() * mask).sum()) / max(tokens, 1), tokens)
            loss = _with_router_loss(loss, engine.model, s, mask, num_tokens, actor.context, mean)
            if ent is not None:
                ent_agg = aggregate(ent, mask, s.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                                    max_len=s.max_len)
                if s.entropy_coef:
                    loss = loss - s.entropy_coef * ent_agg
                mean.add("entropy", float((ent.detach() * mask).sum()) / max(tokens, 1), tokens)
            engine.backward(loss)
            for name in ("clip_ratio", "ppo_kl", "dual_clip_frac", "rollout_kl", "logprob_abs_gap",
                         "is_clamp_frac", "is_filter_frac", "is_seq_filter_frac"):
                if name in m:
                    mean.add(name, float(m[name]), tokens)
            step_loss += float(loss.detach())
        mean.add("policy_loss", step_loss)
        mean.add("grad_norm", engine.step())
        actor.update_ema()
        mean.add("rows_per_step", len(rows))  # this rank's (the controller sums the ranks)
    out = mean.result("actor")
    out["train/rows_per_step"] = out.pop("actor/rows_per_step")
    out.update(rollout_gap.result("rollout"))
    out["actor/lr"] = engine.lr
    out.update(_ring_traffic(actor.context))
    if weights_out is not None:
        weights_out.update({f"actor/{k}": w for k, w in mean.weights.items()})
        weights_out.update({f"rollout/{k}": w for k, w in rollout_gap.weights.items()})
    return out


def _with_router_loss(loss, model, s: UpdateSettings, mask, num_tokens: float, context, mean: _Mean):
    """`loss` + coef x the MoE router loss of the micro-batch's forward (`models.moe`), weighted by its share
    of the step's action tokens (over a context-parallel group: each rank's slice, so divided by the group
    size); logged as `aux_loss` (the token-weighted mean)."""
    aux = take_router_loss(model) if s.router_loss_coef > 0 else None
    if aux is None:
        return loss
    tokens = float(mask.sum())
    mean.add("aux_loss", float(aux.detach()), tokens)
    return loss + s.router_loss_coef * aux * tokens / max(num_tokens, 1.0) / (context.size if context else 1)


def _ring_traffic(context) -> dict[str, float]:
    """With a context-parallel group: the bytes and seconds of its collectives since the last report (this
    step's forwards and the update), as `comm/cp_bytes` / `comm/cp_seconds`."""
    if context is None:
        return {}
    moved = cp_traffic()
    return {"comm/cp_bytes": float(moved["bytes"]), "comm/cp_seconds": moved["seconds"]}


def critic_shuffle_step(step: int) -> int:
    """The critic shuffles its optimizer steps with its own seed (`optimizer_steps(n, s, this)`)."""
    return step + 7919


def update_critic(critic, exp: Experience, s: UpdateSettings, step: int, step_rows=None,
                  weights_out: dict | None = None) -> dict[str, float]:
    """The value update of `roles.Critic.fit` (`critic`: its `engine`, `device`, `forward`)."""
    mean = _Mean()
    engine = critic.engine
    for rows in local_steps(exp, s, critic_shuffle_step(step), step_rows):
        batch = exp.select(rows) if len(rows) else _stand_in(exp)
        num_tokens, num_seqs = _counts(batch, engine, critic.context)
        step_loss = 0.0
        for mb in _micro_batches(batch, s.batching, engine, critic.device):
            values = critic.forward(mb, s.batching)
            loss = value_loss(values, mb.values, mb.returns, mb.action_mask, clip=s.value_clip,
                              agg=s.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs, max_len=s.max_len)
            loss = _with_router_loss(loss, engine.model, s, mb.action_mask, num_tokens, critic.context, mean)
            engine.backward(loss)
            step_loss += float(loss.detach())
        mean.add("value_loss", step_loss)
        mean.add("grad_norm", engine.step())
    out = mean.result("critic")
    out["critic/lr"] = engine.lr
    out.update(_ring_traffic(critic.context))
    if weights_out is not None:
        weights_out.update({f"critic/{k}": w for k, w in mean.weights.items()})
    return out
