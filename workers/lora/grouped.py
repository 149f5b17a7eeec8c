"""This step's LoRA tokens grouped by slot, and the kernel paths that add LoRA to a linear's
output for them.

Grouping happens once per step (numpy on the host, a few microseconds); every LoRA linear of
the step reuses it. Two paths, one chosen at start-up (``select_path``):

- "triton" (CUDA): workers/triton_ops/lora.py, shrink then expand, fixed grids;
- "grouped" (CPU): one gather of the LoRA tokens sorted by slot, the shrink and the expand as
  either one batched GEMM each over groups padded to the largest (when that at most doubles
  the rows: decode) or ``torch._grouped_mm`` (one GEMM per slot inside one call), the packed
  projections' expands being one GEMM through a block-diagonal B (slots.SlotBuffers), and
  one index_add into the output: a handful of ops per linear whatever the number of
  adapters; large groups of consecutive tokens (prefills) skip the gather and the scatter and
  accumulate in place. Where this torch build has no grouped GEMM for the target's dtype or strides
  (probed once per target), its unpadded steps run the same per slot in Python ("loop":
  two GEMMs and an index_add per slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from workers.lora.slots import SlotBuffers


@dataclass
class TokenGroups:
    """The step's tokens that run an adapter, sorted by slot (stable)."""

    tokens: torch.Tensor  # [n] int64: token indices, slot 0's first
    tokens32: torch.Tensor  # the same, int32 (the Triton kernels)
    ends: torch.Tensor  # [S] int32: cumulative token counts per slot (grouped GEMM offsets)
    starts: torch.Tensor  # [S] int32
    counts: torch.Tensor  # [S] int32
    max_count: int
    spans: list[tuple[int, int, int]]  # (slot, start, end) of the non-empty slots (host)
    # the non-empty slots lie in [slot_lo, slot_hi): the torch paths run over that range only
    slot_lo: int
    slot_hi: int
    # (slot, lo, hi) per non-empty slot when each slot's tokens are the consecutive tokens
    # lo..hi-1 and the groups are large (prefills, one adapter per step): the torch path then
    # reads x and adds into y in place, projection by projection, with no gather or scatter
    runs: list[tuple[int, int, int]] | None
    # Padded groups, when padding every slot of the range to max_count tokens at most doubles
    # the rows: one batched GEMM instead of one GEMM per slot (small decode groups pay per
    # call, not per FLOP). pad_tokens [G * max_count]: the token each padded row reads (pads
    # read any token and are dropped); valid [n]: the real rows' positions, None when no row
    # is padding. None: grouped GEMMs.
    pad_tokens: torch.Tensor | None
    valid: torch.Tensor | None


def group_tokens(token_slots: np.ndarray, num_slots: int, device: torch.device
                 ) -> TokenGroups | None:
    """token_slots [T] int32 (-1: the base model) -> the groups, or None when no token runs an
    adapter (then the step runs no LoRA op at all)."""
    lora = np.flatnonzero(token_slots >= 0)
    n = len(lora)
    if not n:
        return None
    slots = token_slots[lora]
    order = np.argsort(slots, kind="stable")
    tokens = lora[order]
    counts = np.bincount(slots, minlength=num_slots).astype(np.int32)
    ends = np.cumsum(counts, dtype=np.int32)
    starts = ends - counts
    spans = [(s, int(starts[s]), int(ends[s])) for s in np.flatnonzero(counts).tolist()]
    runs = None
    if n >= RUN_TOKENS * len(spans):
        firsts = tokens[[a for _, a, _ in spans]]
        lasts = tokens[[b - 1 for _, _, b in spans]]
        if all(last - first == b - a - 1 for first, last, (_, a, b)
               in zip(firsts.tolist(), lasts.tolist(), spans, strict=True)):
            runs = [(s, f, f + b - a) for f, (s, a, b) in zip(firsts.tolist(), spans,
                                                               strict=True)]
    slot_lo, slot_hi = spans[0][0], spans[-1][0] + 1
    m = int(counts.max())

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    pad_tokens = valid = None
    rows = (slot_hi - slot_lo) * m
    if rows <= 2 * n:
        sorted_slots = slots[order]
        pos = (sorted_slots - slot_lo) * m + np.arange(n) - starts[sorted_slots]
        pad = np.full(rows, tokens[0], dtype=np.int64)
        pad[pos] = tokens
        pad_tokens = dev(pad)
        valid = dev(pos.astype(np.int64)) if rows != n else None
    return TokenGroups(tokens=dev(tokens.astype(np.int64)), tokens32=dev(tokens.astype(np.int32)),
                       ends=dev(ends), starts=dev(starts), counts=dev(counts), max_count=m,
                       spans=spans, slot_lo=slot_lo, slot_hi=slot_hi, runs=runs,
                       pad_tokens=pad_tokens, valid=valid)


# tokens per slot (on average) from which consecutive groups take one GEMM per slot and packed
# projection in place rather than a gather, batched GEMMs and a scatter
RUN_TOKENS = 32

# A path adds the LoRA products of one linear to its output y in place.
LoRAPath = Callable[[torch.Tensor, torch.Tensor, "SlotBuffers", TokenGroups], None]


def add_grouped(x: torch.Tensor, y: torch.Tensor, bufs: SlotBuffers, g: TokenGroups) -> None:
    if g.runs is not None:
        return _add_runs(x, y, bufs, g.runs)
    lo, hi = g.slot_lo, g.slot_hi
    a_t, b_t = bufs.a_t[lo:hi], bufs.b_t[lo:hi]
    if g.pad_tokens is not None:
        xs = x.index_select(0, g.pad_tokens).view(hi - lo, g.max_count, -1)
        d = _expand(torch.bmm(xs, a_t), b_t, bufs).view(len(g.pad_tokens), -1)
        if g.valid is not None:
            d = d.index_select(0, g.valid)
    elif not bufs.grouped_mm_ok:
        return add_loop(x, y, bufs, g)
    else:
        ends = g.ends[lo:hi]
        t = torch._grouped_mm(x.index_select(0, g.tokens), a_t, offs=ends)
        r, off = bufs.rank, bufs.offsets
        d = torch.cat([torch._grouped_mm(t[:, j * r:(j + 1) * r], b_t[:, :, off[j]:off[j + 1]],
                                         offs=ends) for j in range(bufs.num_slices)], dim=1)
    y.index_add_(0, g.tokens, d)


def _expand(t: torch.Tensor, b_t: torch.Tensor, bufs: SlotBuffers) -> torch.Tensor:
    """Each packed projection's rank block of the shrink t [..., NS * R] times its columns of
    b_t [..., R, out] -> [..., out] (batched over leading dims, as matmul broadcasts)."""
    if bufs.num_slices == 1:
        return torch.matmul(t, b_t)
    r, off = bufs.rank, bufs.offsets
    d = t.new_empty(*t.shape[:-1], b_t.shape[-1])
    for j in range(bufs.num_slices):
        torch.matmul(t[..., j * r:(j + 1) * r], b_t[..., off[j]:off[j + 1]],
                     out=d[..., off[j]:off[j + 1]])
    return d


def _add_runs(x: torch.Tensor, y: torch.Tensor, bufs: SlotBuffers,
              runs: list[tuple[int, int, int]]) -> None:
    """Large consecutive groups: the shrink on a view of x, each packed projection's expand
    accumulated into its columns of y in place (no temporary of y's size)."""
    r, off = bufs.rank, bufs.offsets
    for slot, lo, hi in runs:
        t = x[lo:hi] @ bufs.a_t[slot]
        b = bufs.b_t[slot]
        for j in range(bufs.num_slices):
            y[lo:hi, off[j]:off[j + 1]].addmm_(t[:, j * r:(j + 1) * r], b[:, off[j]:off[j + 1]])


def add_loop(x: torch.Tensor, y: torch.Tensor, bufs: SlotBuffers, g: TokenGroups) -> None:
    for slot, start, end in g.spans:
        rows = g.tokens[start:end]
        t = x.index_select(0, rows) @ bufs.a_t[slot]
        y.index_add_(0, rows, _expand(t, bufs.b_t[slot], bufs))


def add_triton(x: torch.Tensor, y: torch.Tensor, bufs: SlotBuffers, g: TokenGroups) -> None:
    from workers.triton_ops.lora import lora_add

    lora_add(x, y, bufs.a, bufs.b, bufs.offsets_dev, bufs.max_slice, g.tokens32, g.starts,
             g.counts, g.max_count)


PATHS: dict[str, LoRAPath] = {"triton": add_triton, "grouped": add_grouped, "loop": add_loop}


def path_for(path: str, bufs: SlotBuffers) -> LoRAPath:
    """The path one target takes, decided once at start-up. torch's grouped GEMM wants
    16-byte aligned strides, which odd feature counts (tiny test models, some TP slices) do
    not have: such a target's grouped path runs its unpadded steps through the loop."""
    if path == "grouped":
        x = torch.zeros(3, bufs.a_t.shape[1], dtype=bufs.a_t.dtype, device=bufs.a_t.device)
        g = TokenGroups(tokens=torch.arange(3), tokens32=torch.arange(3, dtype=torch.int32),
                        ends=torch.full((bufs.a_t.shape[0],), 3, dtype=torch.int32),
                        starts=torch.zeros(0), counts=torch.zeros(0), max_count=3, spans=[],
                        slot_lo=0, slot_hi=bufs.a_t.shape[0], runs=None, pad_tokens=None,
                        valid=None)
        try:
            add_grouped(x, torch.zeros(3, bufs.b_t.shape[2], dtype=x.dtype), bufs, g)
        except (AttributeError, RuntimeError, NotImplementedError):  # or an older torch
            bufs.grouped_mm_ok = False
    return PATHS[path]


def select_path(device: torch.device) -> str:
    """The kernel path for this device, decided once at start-up: the Triton kernels on CUDA
    (when triton is installed), the torch ops elsewhere."""
    from workers import triton_ops

    return "triton" if device.type == "cuda" and triton_ops.available() else "grouped"
