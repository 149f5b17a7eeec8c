"""Which prefill ranks hold which of a decode rank's KV heads.

Under TP each rank holds ``kv_heads`` = ceil(H / tp) of the model's H KV heads (padded, as the
model splits them: workers/model/llama.py TPLayout): rank r holds global heads
``[r * kv_heads, (r + 1) * kv_heads)``, those at or past H being padding (zero weights, never
read by a real query head). A decode rank needs its real heads; each lives on exactly one
prefill rank. Equal TP sizes: one slice, all heads, from the same rank. Prefill TP 1, decode
TP 2: each decode rank takes half of rank 0's heads. Prefill TP 2, decode TP 1: rank 0 takes
the heads of both prefill ranks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``[remote_start, remote_end)`` of ``remote_rank`` (its own numbering) go to this
    rank's heads from ``local_start`` on."""

    remote_rank: int
    remote_start: int
    remote_end: int
    local_start: int

    @property
    def num_heads(self) -> int:
        return self.remote_end - self.remote_start


def head_slices(total_heads: int, local_rank: int, local_heads: int, remote_tp: int,
                remote_heads: int) -> list[HeadSlice]:
    """The slices a rank (holding ``local_heads`` per rank) reads from ranks of a remote TP
    size ``remote_tp`` (``remote_heads`` per rank), for the ``total_heads`` real heads."""
    if remote_heads * remote_tp < total_heads or local_heads < 1 or remote_heads < 1:
        raise ValueError(f"{remote_tp} ranks of {remote_heads} KV heads cannot hold "
                         f"{total_heads} heads")
    lo = local_rank * local_heads
    hi = min(lo + local_heads, total_heads)  # padding heads need no KV
    out = []
    g = lo
    while g < hi:
        r = g // remote_heads
        end = min(hi, (r + 1) * remote_heads)
        out.append(HeadSlice(r, g - r * remote_heads, end - r * remote_heads, g - lo))
        g = end
    return out
