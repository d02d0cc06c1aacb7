"""The models of an RL run, each behind a small role object so a placement other than
in-process (Ray actor groups) can implement the same methods without changing the trainer:
`Actor` (trained policy: log-probs, entropy, EMA), `Reference` (frozen policy: log-probs),
`Critic` (trained value model: per-token values).

Forward passes run over micro-batches of `Batching.micro_batch_size` samples, or with a token
budget (`max_tokens`, --train/--rollout.max_tokens_per_gpu with --train.dynamic_batch_enable), and
with `packed` (--ds.packing_samples) each micro-batch is one row without padding (block-diagonal
attention): the per-token outputs are scattered back to the padded `[b, T-1]` layout, equal to the
padded computation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms.losses import entropy, token_logprobs
from posttrain.models import forward_logits, forward_values
from posttrain.trainers import batching
from posttrain.trainers.rl.experience import Experience


@dataclass(frozen=True)
class Batching:
    micro_batch_size: int
    max_tokens: int | None = None  # set => micro-batches by token budget
    packed: bool = False

    def micro_batches(self, exp: Experience) -> list[list[int]]:
        """Row groups of `exp`, in order: by count, or greedily by `max_tokens` real tokens."""
        lengths = exp.attention_mask.sum(1).tolist()
        return batching.micro_batches(range(len(exp)), lengths, micro_batch_size=self.micro_batch_size,
                                      max_tokens=self.max_tokens)


def _packed_batch(exp: Experience) -> tuple[dict, torch.Tensor]:
    """One packed row of `exp`'s real tokens (right padding: row-major order keeps each sample
    contiguous), and the boolean [b, T] map of where each packed token came from."""
    real = exp.attention_mask.bool()
    positions = exp.attention_mask.long().cumsum(1) - 1
    return {"input_ids": exp.sequences[real][None], "position_ids": positions[real][None]}, real


def _unpack(flat: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per-token values of the packed row ([N]) back to the padded layout [b, T] (0 on padding)."""
    out = flat.new_zeros(real.shape)
    out[real] = flat
    return out


def policy_forward(model, exp: Experience, temperature: float, with_entropy: bool = False, packed: bool = False):
    """Log-probs `[b, T-1]` of the sampled tokens under `logits / temperature` (and the entropy of
    that distribution when asked) — the same computation as the rollout engine's. Column t scores
    token t+1; columns at padding (and, packed, at each sample's last token) are meaningless and
    must be masked by the caller's action mask."""
    if not packed:
        logits = forward_logits(model, exp.model_batch())[:, :-1]
        logp = token_logprobs(logits, exp.sequences[:, 1:], temperature)
        return logp, (entropy(logits, temperature) if with_entropy else None)
    inputs, real = _packed_batch(exp)
    logits = forward_logits(model, inputs)[0]  # [N, V]
    targets = torch.roll(inputs["input_ids"][0], -1)  # the next packed token (crosses samples at their ends)
    logp = _unpack(token_logprobs(logits, targets, temperature), real)[:, :-1]
    ent = _unpack(entropy(logits, temperature), real)[:, :-1] if with_entropy else None
    return logp, ent


def value_forward(model, exp: Experience, packed: bool = False) -> torch.Tensor:
    """Value of each state before an action: V(tokens ≤ t) in column t, `[b, T-1]`."""
    if not packed:
        return forward_values(model, exp.model_batch())[:, :-1]
    inputs, real = _packed_batch(exp)
    return _unpack(forward_values(model, inputs)[0], real)[:, :-1]


class _Scorer:
    def __init__(self, model, device) -> None:
        self.model = model
        self.device = device

    def _per_token(self, exp: Experience, batches: Batching, fn) -> torch.Tensor:
        out = torch.zeros_like(exp.action_mask)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for rows in batches.micro_batches(exp):
                part = exp.select(rows)
                out[rows, : part.action_mask.shape[1]] = fn(_to(part, self.device)).float().cpu() * part.action_mask
        self.model.train(was_training)
        return out


class Actor(_Scorer):
    """The trained policy. With `ema_beta`, an exponential moving average of its weights is kept
    (`ema ← β·ema + (1-β)·θ` after every optimizer step, as OpenRLHF) for the final export."""

    def __init__(self, model, engine, temperature: float, device, ema_beta: float | None = None) -> None:
        super().__init__(model, device)
        self.engine = engine
        self.temperature = temperature
        self.ema_beta = ema_beta
        self.ema = None
        if ema_beta is not None:
            self.ema = {k: v.detach().clone().float() for k, v in model.state_dict().items()}

    def logprobs(self, exp: Experience, batches: Batching) -> torch.Tensor:
        return self._per_token(exp, batches,
                               lambda part: policy_forward(self.engine.model, part, self.temperature,
                                                           packed=batches.packed)[0])

    def update_ema(self) -> None:
        if self.ema is None:
            return
        beta = self.ema_beta
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                self.ema[k].mul_(beta).add_(v.float(), alpha=1 - beta)

    def ema_state_dict(self) -> dict | None:
        """The EMA weights in the model's own dtypes (None without EMA)."""
        if self.ema is None:
            return None
        dtypes = {k: v.dtype for k, v in self.model.state_dict().items()}
        return {k: v.to(dtypes[k]) for k, v in self.ema.items()}


class Reference(_Scorer):
    def __init__(self, model, temperature: float, device, offload: bool = False) -> None:
        super().__init__(model, device)
        self.temperature = temperature
        self.offload = offload and device.type != "cpu"
        if self.offload:
            self.model.to("cpu")

    def logprobs(self, exp: Experience, batches: Batching) -> torch.Tensor:
        if self.offload:
            self.model.to(self.device)
        try:
            return self._per_token(exp, batches, lambda part: policy_forward(
                self.model, part, self.temperature, packed=batches.packed)[0])
        finally:
            if self.offload:
                self.model.to("cpu")


class Critic(_Scorer):
    """The value model. With `normalize` (--reward.normalize_enable) its values are
    `(v - mean) / std` with the mean/std stored in its config (a critic started from a reward model
    trained by `posttrain rm` carries them; OpenRLHF's critic does the same); without them, unchanged."""

    def __init__(self, model, engine, device, normalize: bool = False) -> None:
        super().__init__(model, device)
        self.engine = engine
        config = getattr(model, "config", None)
        mean, std = getattr(config, "mean", None), getattr(config, "std", None)
        self.mean, self.std = (float(mean), float(std)) if normalize and mean is not None and std else (0.0, 1.0)

    def values(self, exp: Experience, batches: Batching) -> torch.Tensor:
        return self._per_token(exp, batches, lambda part: self.forward(part, batches.packed))

    def forward(self, part: Experience, packed: bool = False) -> torch.Tensor:
        """Value of each state before an action: V(tokens ≤ t) in column t, `[b, T-1]` (normalised)."""
        return (value_forward(self.engine.model, part, packed) - self.mean) / self.std


def _to(exp: Experience, device) -> Experience:
    if device.type == "cpu":
        return exp
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in exp.__dict__.items()}
    return Experience(**fields)
