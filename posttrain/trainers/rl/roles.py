"""The models of an RL run, each behind a small role object so a placement other than
in-process (Ray actor groups) can implement the same methods without changing the trainer:
`Actor` (trained policy: log-probs, entropy), `Reference` (frozen policy: log-probs),
`Critic` (trained value model: per-token values)."""
from __future__ import annotations

import torch

from posttrain.algorithms.losses import entropy, token_logprobs
from posttrain.models import forward_logits, forward_values
from posttrain.trainers.rl.experience import Experience


def _chunks(n: int, size: int):
    for start in range(0, n, max(size, 1)):
        yield list(range(start, min(start + size, n)))


def policy_forward(model, exp: Experience, temperature: float, with_entropy: bool = False):
    """Log-probs `[b, T-1]` of the sampled tokens under `logits / temperature` (and the entropy of
    that distribution when asked) — the same computation as the rollout engine's."""
    logits = forward_logits(model, exp.model_batch())[:, :-1]
    logp = token_logprobs(logits, exp.sequences[:, 1:], temperature)
    return logp, (entropy(logits, temperature) if with_entropy else None)


class _Scorer:
    def __init__(self, model, device) -> None:
        self.model = model
        self.device = device

    def _per_token(self, exp: Experience, micro_batch_size: int, fn) -> torch.Tensor:
        out = torch.zeros_like(exp.action_mask)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for rows in _chunks(len(exp), micro_batch_size):
                part = exp.select(rows)
                out[rows, : part.action_mask.shape[1]] = fn(part).float().cpu() * part.action_mask
        self.model.train(was_training)
        return out


class Actor(_Scorer):
    def __init__(self, model, engine, temperature: float, device) -> None:
        super().__init__(model, device)
        self.engine = engine
        self.temperature = temperature

    def logprobs(self, exp: Experience, micro_batch_size: int) -> torch.Tensor:
        return self._per_token(exp, micro_batch_size,
                               lambda part: policy_forward(self.engine.model, _to(part, self.device), self.temperature)[0])


class Reference(_Scorer):
    def __init__(self, model, temperature: float, device, offload: bool = False) -> None:
        super().__init__(model, device)
        self.temperature = temperature
        self.offload = offload and device.type != "cpu"
        if self.offload:
            self.model.to("cpu")

    def logprobs(self, exp: Experience, micro_batch_size: int) -> torch.Tensor:
        if self.offload:
            self.model.to(self.device)
        try:
            return self._per_token(exp, micro_batch_size,
                                   lambda part: policy_forward(self.model, _to(part, self.device), self.temperature)[0])
        finally:
            if self.offload:
                self.model.to("cpu")


class Critic(_Scorer):
    def __init__(self, model, engine, device) -> None:
        super().__init__(model, device)
        self.engine = engine

    def values(self, exp: Experience, micro_batch_size: int) -> torch.Tensor:
        return self._per_token(exp, micro_batch_size, lambda part: self.forward(part))

    def forward(self, part: Experience) -> torch.Tensor:
        """Value of each state before an action: V(tokens ≤ t) in column t, `[b, T-1]`."""
        return forward_values(self.engine.model, _to(part, self.device).model_batch())[:, :-1]


def _to(exp: Experience, device) -> Experience:
    if device.type == "cpu":
        return exp
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in exp.__dict__.items()}
    return Experience(**fields)
