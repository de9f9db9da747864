"""Which rows of the training split a training process holds, and an epoch's order of them.

A local run holds every row. A Ray Train worker of rank r among `world` holds only rows r,
r + world, r + 2·world, … of the driver's stacked training split (which is already shuffled by
seed, so every shard is a random sample of it): its own shard, the only part of the data put in
the object store for it. An epoch's order is drawn from the generator every process shares, and
interleaves the shards (each shard shuffled, their rows alternating), so that every batch holds
as many rows of each shard as it can (they differ by one at most) and each process trains on the
rows of the batch it holds: no process needs another's rows. With one process the order is the
local run's `torch.randperm` (bit for bit).

`units` are each row's weight in a batch's loss (a segmenter's labelled pixels, a detector's
objects), for every row of the split: a process weights its share's loss by its part of the
whole batch's units without seeing the other rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Shard:
    total: int  # rows in the whole training split
    rank: int = 0
    world: int = 1
    units: torch.Tensor | None = None  # (total,): each row's part of a batch's loss

    def of(self, rank: int, world: int) -> "Shard":
        """The same split's shard of process `rank` among `world`."""
        return replace(self, rank=rank, world=world)

    def size(self, rank: int | None = None) -> int:
        """The rows process `rank` (this one by default) of this shard's world holds."""
        return len(range(self.rank if rank is None else rank, self.total, self.world))

    def rows(self, data):
        """This shard's rows of the whole split's `data` (a tensor or a list), contiguous: what
        the driver puts in the object store for this process."""
        if self.world == 1:
            return data
        part = data[self.rank::self.world]
        return part.contiguous() if isinstance(part, torch.Tensor) else list(part)

    def order(self, generator: torch.Generator) -> torch.Tensor:
        """An epoch's order of all `total` rows (the same on every process): the shards each
        shuffled, position p holding a row of shard p % world."""
        if self.world == 1:
            return torch.randperm(self.total, generator=generator)
        order = torch.empty(self.total, dtype=torch.long)
        for rank in range(self.world):
            order[rank::self.world] = (torch.randperm(self.size(rank), generator=generator)
                                       * self.world + rank)
        return order

    def own(self, rows: torch.Tensor) -> torch.Tensor:
        """Which of the split's `rows` this process holds (a boolean mask)."""
        if self.world == 1:
            return torch.ones(len(rows), dtype=torch.bool)
        return rows % self.world == self.rank

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """The positions in this process's data of the split's `rows` it holds, in order."""
        if self.world == 1:
            return rows
        return rows[self.own(rows)] // self.world

    def units_of(self, rows: torch.Tensor) -> float:
        """The summed units of the split's `rows` (every process's)."""
        return float(self.units[rows].sum()) if self.units is not None else float(len(rows))
