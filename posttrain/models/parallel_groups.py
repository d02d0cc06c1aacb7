"""How a model's ranks are laid out and grouped.

`ParallelLayout`: where a rank sits in a run's (or a role's) ranks: data parallel x context parallel
(ring attention) x tensor parallel.

    rank = (dp * CP + cp) * TP + tp

so a tensor-parallel group is TP consecutive ranks, a context-parallel group the CP ranks of one data-parallel
index and one tp, spaced TP apart; with TP = 1 the context-parallel groups are CP consecutive ranks. The
ranks of a context- or tensor-parallel group take the same rows (data parallelism runs over `dp`).

`ContextGroups`: a model's context-parallel groups (ring attention over N ranks): the run's ranks in groups
of N (`ParallelLayout`); the ranks of a group take the same micro-batches (data parallelism runs
over the groups), and each computes its contiguous slice of every packed row (`models.context_parallel`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from posttrain.models.context_parallel import gather_replicated, next_tokens, slice_row, split_packed


@dataclass(frozen=True)
class ParallelLayout:
    world: int
    context: int = 1  # CP
    tensor: int = 1  # TP

    def __post_init__(self) -> None:
        if self.world % (self.context * self.tensor):
            raise ValueError(f"{self.world} ranks are not a multiple of context {self.context} x tensor "
                             f"{self.tensor}")

    @property
    def data(self) -> int:
        """DP: the number of data-parallel indices."""
        return self.world // (self.context * self.tensor)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(dp, cp, tp) of `rank`."""
        rest, tp = divmod(rank, self.tensor)
        dp, cp = divmod(rest, self.context)
        return dp, cp, tp

    def rank(self, dp: int, cp: int, tp: int) -> int:
        return (dp * self.context + cp) * self.tensor + tp

    def context_groups(self) -> list[list[int]]:
        """Every context-parallel group (ranks of one dp and tp), in rank order of their first member."""
        return [[self.rank(dp, cp, tp) for cp in range(self.context)]
                for dp in range(self.data) for tp in range(self.tensor)]

    def tensor_groups(self) -> list[list[int]]:
        """Every tensor-parallel group (ranks of one dp and cp)."""
        return [[self.rank(dp, cp, tp) for tp in range(self.tensor)]
                for dp in range(self.data) for cp in range(self.context)]

    def data_groups(self) -> list[list[int]]:
        """Every data-parallel group (ranks holding the same slice and shard: one cp and tp)."""
        return [[self.rank(dp, cp, tp) for dp in range(self.data)]
                for cp in range(self.context) for tp in range(self.tensor)]

    def describe(self, label: str = "rank") -> str:
        """One line: each rank's (dp, cp, tp), e.g. `rank 0 (dp 0, cp 0, tp 0), rank 1 (dp 0, cp 1, tp 0)`."""
        return ", ".join(f"{label} {r} (dp {dp}, cp {cp}, tp {tp})"
                         for r, (dp, cp, tp) in ((r, self.coordinates(r)) for r in range(self.world)))


@dataclass
class ContextGroups:
    size: int  # ranks per group (N)
    rank: int  # this rank's place in its group
    group: object  # its torch.distributed group
    dp_rank: int  # its group's index: the data-parallel rank
    dp_size: int  # the number of groups
    head_stride: int

    @staticmethod
    def create(world_rank: int, layout: ParallelLayout, head_stride: int) -> ContextGroups:
        """Every rank calls this (creating a group is collective): the context-parallel groups of `layout`."""
        mine = None
        for ranks in layout.context_groups():
            group = dist.new_group(ranks)
            if world_rank in ranks:
                mine = group
        dp, cp, _ = layout.coordinates(world_rank)
        return ContextGroups(layout.context, cp, mine, dp, layout.data, head_stride)

    def split(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """This rank's slice of one packed row [1, T] as a batch the forwards of `models.forward` run over
        the group: its `input_ids`, `position_ids`, `cp_valid` (False on the padding that made the row
        divisible by the group) and `cp` (this object)."""
        local, valid = split_packed(input_ids, position_ids, self.rank, self.size)
        return {**local, "cp_valid": valid, "cp": self}

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """A per-token output of this rank's slice [..., T_local] → the whole row's [..., T_row]
        (`gather_replicated`: for a loss every rank of the group computes alike)."""
        return gather_replicated(tensor, self.group)

    def shard(self, batch: dict) -> dict:
        """This rank's slice of a packed batch (`pack_collate`: one row, `position_ids`, `loss_mask`): the ids
        and positions, `cp_labels` (the next token where it is a target, else -100; made before the cut),
        `cp_valid` (False on the padding that made the row divisible by the group) and, with `seq_lens`,
        `cp_owner` (each label's sample, -1 on padding); the batch's other keys (`num_pairs`) pass through."""
        ids, pos, mask = batch["input_ids"], batch["position_ids"], batch["loss_mask"]
        labels = next_tokens(ids, -100)
        trained = torch.cat([mask[:, 1:], mask.new_zeros((mask.shape[0], 1))], dim=1).bool()
        labels = labels.masked_fill(~trained, -100)
        cut = lambda t, pad: slice_row(t, self.rank, self.size, pad)  # noqa: E731
        out = {**self.split(ids, pos), "cp_labels": cut(labels, -100)}
        if "seq_lens" in batch:  # the packed sample each label belongs to (that of the token it predicts)
            lens = torch.as_tensor(batch["seq_lens"], device=ids.device)
            owner = torch.repeat_interleave(torch.arange(len(lens), device=ids.device), lens)[1:]
            owner = torch.cat([owner, owner.new_full((1,), -1)])[None]
            out.update(cp_owner=cut(owner, -1), seq_lens=batch["seq_lens"])
        rest = {k: v for k, v in batch.items() if k not in ("input_ids", "position_ids", "loss_mask")}
        return {**rest, **out}
