"""How the vision tower's linears are split over the TP ranks.

Attention heads and MLP rows are split like the LM's (column-parallel in, row-parallel out with
its all-reduce) when the vision heads divide tp_size; otherwise every rank holds the whole tower
and runs it alone (no collective), which gives the same result on every rank either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model.layers import ColumnParallelLinear, RowParallelLinear, pad_to_multiple
from workers.model.vision.config import VisionConfig


@dataclass(frozen=True)
class VisionShard:
    rank: int  # this rank's index among `size` (0 of 1 when replicated)
    size: int
    heads: int  # attention heads on this rank
    inter: int  # MLP rows on this rank (the full width padded up to a multiple of size)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @classmethod
    def of(cls, v: VisionConfig, tp_rank: int, tp_size: int) -> VisionShard:
        if tp_size > 1 and v.num_heads % tp_size == 0:
            return cls(tp_rank, tp_size, v.num_heads // tp_size,
                       pad_to_multiple(v.intermediate_size, tp_size) // tp_size)
        return cls(0, 1, v.num_heads, v.intermediate_size)


def row_linear(shard: VisionShard, in_per_rank: int, out_features: int, bias: bool,
               dtype: torch.dtype, device: torch.device
               ) -> RowParallelLinear | ColumnParallelLinear:
    """A row-parallel linear (partial sums all-reduced, bias once) when sharded, else a plain
    one: a replicated tower must not all-reduce, or each rank's full result would be summed."""
    if shard.sharded:
        return RowParallelLinear(in_per_rank, out_features, bias, shard.rank, dtype, device)
    return ColumnParallelLinear(in_per_rank, out_features, bias, dtype, device)
