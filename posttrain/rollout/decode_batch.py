"""The HF engine's decode loop as a continuous batch: sequences join (`admit`) and leave (`step` returns
the finished ones) between decode steps, each with a KV cache of its own (one row of a padded cache).

State: `rows` (one `Sequence` each, in batch order), the model's `DynamicCache` [B, heads, T, dim] per
layer, `mask` [B, T] (1 = a real token of that row), `positions` [B] (the next position id of each
row) and `logits` [B, V] (next-token logits of each row).

* `admit(sequences)` prefills the new prompts together (left-padded; position ids `cumsum(mask) - 1`,
  so each row sees positions 0..L-1 exactly as if it ran alone) and merges them into the running
  batch: the shorter of the two caches is left-padded with masked zero columns. A row never attends a
  masked column, so its logits do not depend on who shares its batch (up to float rounding).
* `step()` samples one token per row (`sample_next`, each row from its own generator, rows grouped by
  temperature and top-p; a row's stop ids banned until it has `min_tokens` tokens), appends it, and returns
  the sequences that finished: a stop token (kept in the output) or the row's own budget. Finished rows stay
  in the batch (their draws are discarded) until a quarter of it has finished, then leave it and the cache;
  columns every remaining row masks are trimmed from the left. The rows that remain take one decode forward
  for their next logits. A cancelled row (`Sequence.cancelled`, its caller gave up) counts as finished and
  is never returned.

A model whose cache is not made of plain full-attention layers (sliding-window, linear-attention or
hybrid caches) cannot merge caches: there `mergeable` is False and a sequence joins only an empty batch
(batch-boundary scheduling), which `HFRolloutEngine` then uses."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from posttrain.rollout.sampling import sample_next
from posttrain.rollout.types import RolloutOutput

_COMPACT_FRACTION = 0.25  # drop finished rows from the batch once this fraction of it has finished
_DRAW_BLOCK = 64  # uniform draws a sequence takes from its generator at a time


@dataclass(eq=False)
class Sequence:
    """One sample in flight: its prompt, budget (`limit` tokens), sampling settings, stop ids and own
    generator; `ticket` is the caller's handle (which request and sample this is)."""
    prompt: list[int]
    limit: int
    temperature: float
    top_p: float
    stop: frozenset[int]
    generator: torch.Generator
    ticket: object = None
    min_tokens: int = 0  # the stop ids cannot be drawn before this many tokens
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights version of each token
    stopped: bool = False
    cancelled: bool = False  # its caller gave up: it leaves the batch at the next step, never settled
    _draws: list[float] = field(default_factory=list, repr=False)  # drawn, not yet used (reversed)

    def uniform(self) -> float:
        """The next U[0, 1) float64 draw of this sample's generator, drawn `_DRAW_BLOCK` at a time (a CPU
        generator gives the same numbers drawn one by one or as a block; tests/rollout check it)."""
        if not self._draws:
            self._draws = torch.rand(_DRAW_BLOCK, generator=self.generator,
                                     dtype=torch.float64).tolist()[::-1]
        return self._draws.pop()

    @property
    def done(self) -> bool:
        return self.stopped or self.cancelled or len(self.tokens) >= self.limit

    def output(self) -> RolloutOutput:
        return RolloutOutput(prompt_token_ids=list(self.prompt), output_token_ids=list(self.tokens),
                             logprobs=list(self.logprobs), finish_reason="stop" if self.stopped else "length",
                             policy_versions=list(self.versions))


def _layers(cache):
    return getattr(cache, "layers", None)


class DecodeBatch:
    """`forward(input_ids, attention_mask, position_ids, cache, last_only) -> logits [B, V]` and
    `new_cache()` come from the engine; `pad_token_id` fills left padding; `weights() -> (epoch,
    version)` says which weights the model holds (the epoch changes on every load). Call under
    `torch.no_grad()`, and keep the weights still during one `admit` or `step`. Sequences admitted
    together with the same text (the n samples of a prompt) are prefilled once: that row's cache and
    last logits are copied to each of them (a cache whose rows cannot be copied prefills every row).

    New weights mid-generation (partial rollout): the next `admit` or `step` re-prefills every live row
    (prompt + tokens so far) with them, so each token's log-prob is exactly that of the version that
    sampled it (recorded in `Sequence.versions`), and no cache from older weights is attended."""

    def __init__(self, forward, new_cache, pad_token_id: int, device, weights=lambda: (0, 0),
                 adopt=lambda cache: cache) -> None:
        self._forward, self._new_cache, self._weights, self._adopt = forward, new_cache, weights, adopt
        self.pad_token_id, self.device = pad_token_id, device
        self.rows: list[Sequence] = []
        self.cache = self.mask = self.positions = self.logits = None
        self.mergeable = True  # known after the first prefill
        self.epoch = None  # the weights epoch the cache and logits were computed with
        self.refreshes = 0  # re-prefills after a weight change (tests, metrics)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def live(self) -> int:
        """Rows still generating (finished rows awaiting compaction excluded)."""
        return sum(not s.done for s in self.rows)

    def can_admit(self) -> bool:
        return not self.rows or self.mergeable

    # -- joining -------------------------------------------------------------------------------
    def admit(self, sequences: list[Sequence]) -> None:
        sequences = [s for s in sequences if not s.done]  # cancelled while it waited
        if not sequences:
            return
        if not self.can_admit():
            raise RuntimeError("this model's cache cannot merge sequences mid-generation; admit into an "
                               "empty batch")
        self._refresh_if_stale()
        self.epoch = self._weights()[0]
        texts = [s.prompt + s.tokens for s in sequences]  # tokens: a sequence re-admitted after new weights
        cache, mask, lengths, logits = self._prefill_shared(texts)
        layers = _layers(cache)
        t = mask.shape[1]
        if not self.rows:
            self.rows, self.cache, self.mask, self.positions, self.logits = (list(sequences), cache, mask,
                                                                               lengths, logits)
            return
        width = max(self.mask.shape[1], t)
        for own, new in zip(_layers(self.cache), layers):
            _store(own, torch.cat([_left_pad(own.keys, width), _left_pad(new.keys, width)]),
                   torch.cat([_left_pad(own.values, width), _left_pad(new.values, width)]))
        self.mask = torch.cat([_left_pad(self.mask, width, dim=1), _left_pad(mask, width, dim=1)])
        self.positions = torch.cat([self.positions, lengths])
        self.logits = torch.cat([self.logits, logits])
        self.rows += sequences

    def _prefill_shared(self, texts: list[list[int]]):
        """`_prefill` with each distinct text computed once (the n samples of a prompt), its cache rows and
        logits copied to every text equal to it; every row prefilled where the cache cannot be copied."""
        unique = list(dict.fromkeys(map(tuple, texts)))
        if len(unique) == len(texts) or not self.mergeable:
            return self._prefill(texts)
        cache, mask, lengths, logits = self._prefill([list(x) for x in unique])
        if not self.mergeable:  # learned from this prefill
            return self._prefill(texts)
        where = {text: i for i, text in enumerate(unique)}
        inverse = torch.tensor([where[tuple(x)] for x in texts], device=self.device)
        for layer in _layers(cache):
            index = inverse.to(layer.keys.device)
            _store(layer, layer.keys[index], layer.values[index])
        return cache, mask[inverse], lengths[inverse], logits[inverse]

    def _prefill(self, texts: list[list[int]]):
        """One forward over the left-padded `texts`: (cache, mask, lengths, last-position logits); sets
        `mergeable` (the cache is a list of plain key/value layers, adopted by the engine's buffer)."""
        lens = [len(x) for x in texts]
        t = max(lens)
        ids = torch.tensor([[self.pad_token_id] * (t - n) + x for x, n in zip(texts, lens)],
                           dtype=torch.long, device=self.device)
        lengths = torch.tensor(lens, dtype=torch.long, device=self.device)
        mask = (torch.arange(t, device=self.device)[None, :] >= (t - lengths)[:, None]).long()
        cache = self._new_cache()
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, True)
        layers = _layers(cache)
        self.mergeable = (layers is not None
                          and all(type(layer).__name__ == "DynamicLayer" for layer in layers))
        if self.mergeable:
            cache = self._adopt(cache)
        return cache, mask, lengths, logits

    def admit_waiting(self, pending, cap: int) -> list[Sequence]:
        """Admit sequences from the left of the deque `pending` while the batch has fewer than `cap` rows
        (and can take them); returns those admitted. If the admission fails they are back in `pending`."""
        if not (pending and self.can_admit() and len(self) < cap):
            return []
        joining = [pending.popleft() for _ in range(min(cap - len(self), len(pending)))]
        try:
            self.admit(joining)
        except BaseException:
            pending.extendleft(reversed(joining))
            raise
        return joining

    # -- one decode step -----------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Sample one token for every row; return the sequences this step finished."""
        if not self.rows:
            return []
        self._refresh_if_stale()
        version = self._weights()[1]
        tokens, logprobs = self._sample()
        finished = []
        for s, tok, lp in zip(self.rows, tokens.tolist(), logprobs.tolist()):
            if s.done:
                continue  # finished earlier, awaiting compaction: its draw is discarded
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            s.stopped = tok in s.stop
            if s.done:
                finished.append(s)
        live = [i for i, s in enumerate(self.rows) if not s.done]
        if not live:
            self.rows, self.cache, self.mask, self.positions, self.logits = [], None, None, None, None
            return finished
        if len(self.rows) - len(live) >= _COMPACT_FRACTION * len(self.rows):
            self._keep(torch.tensor(live, device=self.device))
            tokens = tokens[live]
        ones = torch.ones(len(self.rows), 1, dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        self.logits = self._forward(tokens[:, None], self.mask, self.positions[:, None], self.cache, False)
        self.positions = self.positions + 1
        return finished

    def _refresh_if_stale(self) -> None:
        """The weights changed since the cache was computed: re-prefill the live rows with the new ones."""
        if not self.rows or self._weights()[0] == self.epoch:
            return
        live = [s for s in self.rows if not s.done]
        self.rows, self.cache, self.mask, self.positions, self.logits = [], None, None, None, None
        self.refreshes += 1
        self.admit(live)

    def _sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        groups: dict[tuple[float, float], list[int]] = {}
        for i, s in enumerate(self.rows):
            groups.setdefault((s.temperature, s.top_p), []).append(i)
        if len(groups) == 1:
            (temperature, top_p), = groups
            return self._sample_rows(self.logits, self.rows, temperature, top_p)
        tokens = torch.zeros(len(self.rows), dtype=torch.long, device=self.device)
        logprobs = torch.zeros(len(self.rows), dtype=torch.float32, device=self.device)
        for (temperature, top_p), idx in groups.items():
            index = torch.tensor(idx, device=self.device)
            tokens[index], logprobs[index] = self._sample_rows(self.logits[index],
                                                               [self.rows[i] for i in idx], temperature,
                                                               top_p)
        return tokens, logprobs

    def _sample_rows(self, logits: torch.Tensor, rows: list[Sequence], temperature: float, top_p: float):
        """`sample_next` for `rows` (one temperature and top-p), each row's draw from its own generator (a
        finished row awaiting compaction draws nothing: its token is discarded)."""
        uniforms = None
        if temperature > 0:
            uniforms = torch.tensor([0.0 if s.done else s.uniform() for s in rows], dtype=torch.float64,
                                    device=logits.device)
        return sample_next(logits, temperature, top_p, None, uniforms, _banned(rows, logits))

    def _keep(self, index: torch.Tensor) -> None:
        """Keep the rows at `index` (drop finished ones), then trim columns no remaining row attends."""
        self.cache.batch_select_indices(index)
        self.rows = [self.rows[i] for i in index.tolist()]
        self.mask, self.positions, self.logits = self.mask[index], self.positions[index], self.logits[index]
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-masked columns
        if unused and self.mergeable:
            self.mask = self.mask[:, unused:]
            for layer in _layers(self.cache):
                _store(layer, layer.keys[:, :, unused:], layer.values[:, :, unused:])


def _banned(rows: list[Sequence], logits: torch.Tensor) -> torch.Tensor | None:
    """[B, V] bool: the stop ids of every row still below its `min_tokens` (None when no row is)."""
    below = [(i, s.stop) for i, s in enumerate(rows) if s.stop and len(s.tokens) < s.min_tokens
             and not s.done]
    if not below:
        return None
    banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    vocab = logits.shape[-1]
    for i, stop in below:
        ids = [t for t in stop if t < vocab]
        banned[i, ids] = True
    return banned


def _store(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Replace a cache layer's keys and values (a transformers layer's tensors, or `KVLayer.store`)."""
    if hasattr(layer, "store"):
        layer.store(keys, values)
    else:
        layer.keys, layer.values = keys, values


def _left_pad(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """`x` left-padded with zeros to `width` along `dim` (a cache [B, H, T, D] by default, a mask
    with dim 1)."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)
