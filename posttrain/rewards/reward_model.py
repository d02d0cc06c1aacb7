"""A trained reward model (`--reward.model_name_or_path`) as a reward source.

reward(sample) = v[last non-pad token], v = the score head's per-token output (`forward_values`),
for left or right padding alike; with normalisation, (reward - config.mean) / config.std, the
statistics `posttrain rm` (like OpenRLHF) stores in the model's config.json.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from posttrain.rewards.result import RewardError, RewardResult, check_batch
from posttrain.utils.log import warn_once

if TYPE_CHECKING:
    from posttrain.models.setup import ModelSetup


def right_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists → right-padded (input_ids, attention_mask) [B, T]; every row needs a token."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every sequence needs at least one token to be scored by a reward model")
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.as_tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    return ids, mask


class RewardModelSource:
    """RewardSource backed by a score model built by `setup` (a `models.setup.ModelSetup`, role "reward": its
    dtype, attention and expert kernels, head prefix; default: `ModelSetup()`).

    score(queries, ...) tokenises the query texts as given, without the tokenizer's automatic special
    tokens (OpenRLHF's serve_rm: `add_special_tokens=False`, nothing appended, so a query that ends in
    the EOS text is scored as finished and one without as truncated); longer than `max_len` → cut to
    max_len tokens, the last one made eos (as `posttrain rm` cuts its training pairs), counted in
    extra_logs["reward_model/truncated"] and warned. score(..., sequences=ids, attention_mask=mask)
    and `score_tokens(ids)` score given token ids instead (no re-tokenising). Forward passes run in
    chunks of `batch_size` under torch.no_grad.

    Where the model is kept: `zero_stage` 3 in a process of several ranks (a Ray reward group): as this
    rank's ZeRO-3 shards in an inference-only DeepSpeed engine (`engines.zero3.FrozenShards`, its config
    from `ds`); its forwards are collective, so every rank runs as many batches (`values` pads with
    discarded ones, and a rank with nothing to score still calls `score_tokens([])`). `offload`: the
    model stays in CPU memory between forwards where there is an accelerator (a whole copy moves to it
    for each call; shards by DeepSpeed's offload_param); on a CPU there is nothing to offload to."""

    model_role = "reward"  # `ModelSetup.build`'s role: a score model, frozen

    def __init__(self, path, *, setup: ModelSetup | None = None, normalize: bool = False,
                 batch_size: int = 16, max_len: int | None = None, tokenizer=None, device="cpu", ds=None,
                 zero_stage: int | None = None, offload: bool = False):
        from posttrain.engines.dist import env_world, init_process_group
        from posttrain.engines.zero3 import FrozenShards, sharded_loading
        from posttrain.models import load_tokenizer
        from posttrain.models.setup import ModelSetup

        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if max_len is not None and max_len < 2:
            raise ValueError(f"max_len={max_len}: must be >= 2 (or None for no limit)")
        setup = setup if setup is not None else ModelSetup()
        self.path = str(path)
        self.batch_size = batch_size
        self.max_len = max_len
        self.device = torch.device(device)
        self.engine = None  # the FrozenShards of a sharded model
        rank, world, _ = env_world()
        split = setup.ring > 1 and world > 1  # context parallelism over this process's ranks
        built = setup.build(self.path, self.model_role, split_rows=split,
                            sharding=sharded_loading(ds, zero_stage, offload_params=offload))
        model = built.model
        self.offload = offload and self.device.type != "cpu" and not built.sharded
        self.loaded_numel = built.loaded_numel  # (elements this rank holds, of the whole model) once loaded
        if built.sharded:
            self.engine = FrozenShards(model, ds, offload=offload)
            model, self.device = self.engine.module, self.engine.device
        elif not self.offload:
            model = model.to(self.device)
        self.model = model.eval()
        # a context-parallel group whose ranks score the same sequences, each computing its slice of the
        # packed batch (collective: every rank of the reward model builds it), or None
        self.context = None
        if split:
            init_process_group()
            self.context = setup.parallel(built, rank, world, trained=False).context
        self.mean, self.std = 0.0, 1.0
        if normalize:
            mean = getattr(self.model.config, "mean", None)
            std = getattr(self.model.config, "std", None)
            if mean is None or std is None:
                raise RewardError(f"--reward.normalize_enable: reward model {self.path} has no `mean`/`std` "
                                  "in its config.json; train the RM with posttrain rm, or drop "
                                  "--reward.normalize_enable")
            if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
                raise RewardError(f"--reward.normalize_enable: reward model {self.path} has mean={mean}, "
                                  f"std={std} in its config.json; std must be a positive finite number")
            self.mean, self.std = float(mean), float(std)
        self.normalize = normalize
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer or self.path)
        self.tokenizer = tokenizer
        self.num_truncated = 0

    @torch.no_grad()
    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Raw (unnormalised) rewards [B] for padded token ids, read at each row's last non-pad token."""

        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(f"sequences {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be [B, T]")

        def forward(rows: slice | None):
            if rows is None:  # a stand-in batch of one token, its score discarded
                one = torch.ones((1, 1), dtype=torch.long, device=self.device)
                return self._last_values(one * 0, one)
            ids, mask = input_ids[rows].to(self.device), attention_mask[rows].to(self.device)
            return self._last_values(ids, mask).cpu()

        out = self.forward_batches(input_ids.shape[0], forward)
        return torch.cat(out) if out else torch.zeros(0)

    def forward_batches(self, n: int, forward) -> list:
        """``[forward(rows) for rows in slices of batch_size of range(n)]`` under torch.no_grad, with the
        model on its device (offload: moved there for the call); sharded: as many forwards as the rank
        with the most batches (collective), ``forward(None)`` (a stand-in batch, its output discarded) for
        each missing one."""
        starts = list(range(0, n, self.batch_size))
        if self.engine is not None:
            starts += [None] * (self.engine.max_across_ranks(len(starts)) - len(starts))
        out = []
        if self.offload:
            self.model.to(self.device)
        try:
            with torch.no_grad():
                for i in starts:
                    if i is None:
                        forward(None)
                        continue
                    out.append(forward(slice(i, min(i + self.batch_size, n))))
        finally:
            if self.offload:
                self.model.to("cpu")
        return out

    def _last_values(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B] the head's value at each row's last real token; with a context-parallel group, of the rows
        packed into one and split over the group (`models.last_token_values` of the slice)."""
        from posttrain.models import last_token_values

        if self.context is None:
            return last_token_values(self.model, {"input_ids": ids, "attention_mask": mask})
        real = mask.bool()
        part = self.context.split(ids[real][None], (mask.long().cumsum(1) - 1)[real][None])
        return last_token_values(self.model, {**part, "seq_lens": mask.long().sum(1)})

    def tokenize(self, queries: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded (input_ids, attention_mask) [B, T] and a bool [B] of truncated queries."""
        tok = self.tokenizer
        rows = tok(list(queries), add_special_tokens=False)["input_ids"]
        truncated = torch.zeros(len(rows), dtype=torch.bool)
        if self.max_len is not None:
            for i, ids in enumerate(rows):
                if len(ids) > self.max_len:
                    truncated[i] = True
                    rows[i] = ids[:self.max_len]
                    if tok.eos_token_id is not None:
                        rows[i][-1] = tok.eos_token_id
        ids, mask = right_padded(rows, tok.pad_token_id)
        return ids, mask, truncated

    def score(self, queries, prompts=None, labels=None, **kwargs) -> RewardResult:
        n = check_batch(queries, prompts, labels)
        logs = {}
        if kwargs.get("sequences") is not None:
            ids = torch.as_tensor(kwargs["sequences"])
            if kwargs.get("attention_mask") is None:
                raise ValueError("RewardModelSource.score(sequences=...) needs attention_mask=... too "
                                 "(pad ids alone cannot tell padding from real tokens)")
            mask = torch.as_tensor(kwargs["attention_mask"])
            if ids.shape[0] != n:
                raise ValueError(f"sequences has {ids.shape[0]} rows for {n} queries")
        else:
            ids, mask, truncated = self.tokenize(list(queries))
            if bool(truncated.any()):
                self.num_truncated += int(truncated.sum())
                warn_once(f"reward model {self.path}: queries longer than max_len={self.max_len} tokens are "
                          "cut (counted in reward_model/truncated)")
            logs["reward_model/truncated"] = truncated.float()
        rewards = (self.values(ids, mask) - self.mean) / self.std
        return RewardResult(rewards, extra_logs=logs)

    def score_tokens(self, token_ids: list[list[int]]) -> RewardResult:
        """Rewards for sequences given as token ids, exactly as sampled (prompt + response; EOS only
        where the policy sampled it): no decoding, no re-tokenisation, no EOS appended, so a
        truncated response is scored as truncated. The ids must come from a tokenizer sharing this
        model's vocabulary (checked by ``check_vocabulary``). No sequences: no scores (a sharded model
        still runs its share of the other ranks' forwards)."""
        if not token_ids:
            none = torch.zeros((0, 1), dtype=torch.long)
            return RewardResult(self.values(none, none))
        ids, mask = right_padded(token_ids, 0)
        return RewardResult((self.values(ids, mask) - self.mean) / self.std)

    def check_vocabulary(self, tokenizer) -> None:
        """Refuse a policy tokenizer whose ids this model cannot read: more tokens than its
        embedding rows, or (when the model folder has a tokenizer) a different vocabulary."""
        from posttrain.models import load_tokenizer
        from posttrain.models.loading import check_vocab

        check_vocab(self.model, tokenizer, self.path)
        files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
        if not any(os.path.isfile(os.path.join(self.path, f)) for f in files):
            return  # no tokenizer in the folder: the embedding-size check above is all we can do
        if load_tokenizer(self.path).get_vocab() != tokenizer.get_vocab():
            raise RewardError(f"reward model {self.path} has a different tokenizer than the policy; PPO "
                              "scores the policy's sampled token ids (as OpenRLHF does), so both must share "
                              "one vocabulary")

    def close(self) -> None:
        self.model = None

    def __repr__(self) -> str:
        return f"RewardModelSource({self.path!r}, normalize={self.normalize})"
