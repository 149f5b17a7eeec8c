"""Block-id runs: blocks a request got one after another are usually consecutive in both
engines' pools, so a copy of ``n`` blocks is most often a few slice copies (one pass over
memory, no gather into a temporary, and for the TCP pull no copy at all before the socket)
rather than an index_select + index_copy (two passes)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

Run = tuple[int, int, int]  # (first source block, first destination block, length)


def runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Maximal runs where both ids go up by one together."""
    out: list[Run] = []
    for s, d in zip(src, dst, strict=True):
        if out:
            s0, d0, n = out[-1]
            if s == s0 + n and d == d0 + n:
                out[-1] = (s0, d0, n + 1)
                continue
        out.append((s, d, 1))
    return out


def few(rs: list[Run], n: int) -> bool:
    """Slice copies beat index ops: a handful of runs (Python's cost per copy dominates
    beyond that)."""
    return len(rs) <= max(8, n // 8)


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> None:
    """``dst[dst_ids] = src[src_ids]`` over the first dim (any strides, e.g. head slices)."""
    rs = runs(src_ids, dst_ids)
    if few(rs, len(src_ids)):
        for s0, d0, n in rs:
            dst[d0:d0 + n].copy_(src[s0:s0 + n])
        return
    idx = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    part = src.index_select(0, idx)
    dst.index_copy_(0, torch.tensor(dst_ids, dtype=torch.long, device=dst.device),
                    part.to(dst.device))
