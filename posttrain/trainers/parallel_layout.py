"""Where a rank sits in a run's (or a role's) ranks: data parallel x context parallel (--ds.ring_attn_size)
x tensor parallel (--ds.tensor_parallel_size).

    rank = (dp * CP + cp) * TP + tp

so a tensor-parallel group is TP consecutive ranks, a context-parallel group the CP ranks of one data-parallel
index and one tp, spaced TP apart; with TP = 1 the context-parallel groups are CP consecutive ranks. The
ranks of a context- or tensor-parallel group take the same rows (data parallelism runs over `dp`)."""
from __future__ import annotations

from dataclasses import dataclass


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
