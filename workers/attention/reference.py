"""Paged attention in portable torch, the reference every attention backend is tested against:
new K/V go into the block cache through the slot mapping, then every query reads its context
through its block-table row.

One step may mix prefill chunks (continuing from cached context), prefix-cache hits and decodes.
Short queries (decodes, and a token plus its speculative drafts) are computed together in one
batched gather, padded to the longest of them; long prefill chunks loop per request, which costs
little next to their own matmuls. The CPU-kernel and Triton backends (backends/cpu.py,
backends/triton.py) reuse the metadata and, for what their kernels leave, the planning here.

Sliding windows (a layer group's sliding_window W > 0): a query at absolute position p sees the
keys in (p - W, p], as transformers' sliding_window_overlay defines it for Mistral and Qwen2.
Prefill chunks gather only from the block of their first visible key on (the blocks before it
may have been given back to the pool and reused); short queries are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Use torch's fused scaled_dot_product_attention (same math, inputs upcast to float32 so the
# softmax is float32 too); False selects the plain matmul/softmax reference path below.
USE_SDPA = True
# Requests with at most this many new tokens join the batched path (padded to the longest);
# draft verification (1 + K tokens) stays there instead of looping request by request.
MAX_BATCHED_QUERY = 16
# kernel_max_query_len meaning "every request": the kernel tiles queries of any length.
KERNEL_ANY_LENGTH = 1 << 62


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, one per new token
    query_start_loc: torch.Tensor  # [R+1] int32; request i's new tokens are [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [R] int32: num_computed_tokens + num_scheduled_tokens
    block_table: torch.Tensor  # [R, W] int32, padded with 0 (the null block)
    query_start_loc_np: np.ndarray  # host copies: splitting decode/prefill needs no device sync
    seq_lens_np: np.ndarray
    max_query_len: int
    max_seq_len: int


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values [T, kv_heads, hd] into caches [blocks, block_size, kv_heads, hd]."""
    kv_heads, hd = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, hd).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, hd).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class GatherScratch:
    """Reusable destination for the gathered context of one layer (K and V).

    Gathering into fresh tensors costs a page fault per 4 KiB on CPU, which made the gather
    ~6x slower than the copy itself. The buffers grow to the largest step seen and are then
    reused by every layer and step (each layer consumes its context before the next gathers).
    """

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]

    def get(self, which: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs[which]
        if (buf is None or buf.dtype != like.dtype or buf.device != like.device
                or buf.numel() < numel):
            buf = self._bufs[which] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor,
                    scratch: GatherScratch | None = None, which: int = 0) -> torch.Tensor:
    """cache[blocks] flattened over (block, offset): [B, n_blocks * block_size, kv_heads, hd].

    blocks [B, n_blocks]. index_select over whole blocks (contiguous rows) is several times
    faster than advanced indexing of the 4-d cache.
    """
    num_blocks, block_size, kv_heads, hd = cache.shape
    flat = blocks.reshape(-1)
    src = cache.view(num_blocks, -1)
    if scratch is None:
        rows = src.index_select(0, flat)
    else:
        dst = scratch.get(which, flat.numel() * src.shape[1], cache)
        rows = torch.index_select(src, 0, flat, out=dst.view(flat.numel(), src.shape[1]))
    return rows.view(blocks.shape[0], blocks.shape[1] * block_size, kv_heads, hd)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Grouped-query attention over a batch, softmax in float32.

    q [B, L, H, hd]; k, v [B, S, KVH, hd]; allowed [B, L, S] bool -> [B, L, H, hd] in q's dtype.
    """
    b, seq_q, heads, hd = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    k, v = k.float(), v.float()  # no-ops in fp32
    # [B, KVH, group * L, hd]: the queries that share one KV head, as one matrix per batch row.
    qg = q.float().view(b, seq_q, kv_heads, group, hd).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(b, kv_heads, group * seq_q, hd)
    blocked = ~allowed.unsqueeze(1)  # [B, 1, L, S]
    out = torch.empty(b, kv_heads, group * seq_q, hd, dtype=torch.float32, device=q.device)
    # Loop over KV heads (a handful), not requests: k[:, :, h] is a strided view that bmm reads
    # in place, so the gathered context is never transposed or copied again.
    for h in range(kv_heads):
        scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)).mul_(scale)
        scores = scores.view(b, group, seq_q, -1).masked_fill_(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(b, group * seq_q, -1)
        torch.bmm(probs, v[:, :, h], out=out[:, h])
    out = out.view(b, kv_heads, group, seq_q, hd).permute(0, 3, 1, 2, 4)
    return out.reshape(b, seq_q, heads, hd).to(q.dtype)


@dataclass
class Prefill:
    start: int
    end: int
    blocks: torch.Tensor  # [1, n_blocks] int64, from the block of the first visible key on
    seq_len: int  # keys gathered (counted from that block's first key)
    allowed: torch.Tensor  # [1, L, seq_len] causal (and window) mask


@dataclass
class ShortQueries:
    """The batched short queries (decodes, drafts) of a step: D requests of at most Q new tokens
    each, attended in one call. Their tensors exist together, so one plan field holds them."""

    blocks: torch.Tensor  # [D, n_blocks] int64
    allowed: torch.Tensor  # [D, Q, n_blocks * block_size] bool
    # token index of query j of request d, padded by repeating the request's last token;
    # None: a pure decode batch, tokens 0..D-1
    tok: torch.Tensor | None  # [D, Q] int64
    valid: torch.Tensor | None = None  # [D, Q] bool, which queries are real; None: all


@dataclass
class AttentionPlan:
    """Per-step index work shared by every layer: built once per forward, not once per layer."""

    num_tokens: int  # real (non-padding) new tokens
    short: ShortQueries | None  # None: no request is a batched short query
    prefills: list[Prefill]
    scratch: GatherScratch | None = None
    # The CPU kernel computes requests with at most this many new tokens (0: none of them).
    kernel_max_query_len: int = 0
    sliding_window: int = 0  # the layer group's window, 0 = full attention


def plan_attention(meta: AttentionMetadata, block_size: int, device: torch.device,
                   scratch: GatherScratch | None = None,
                   short_queries: bool = True, kernel_all: bool = False,
                   sliding_window: int = 0) -> AttentionPlan:
    """Split the batch into short queries (decodes, drafts: batched) and prefill chunks (one
    by one), using only the host copies, so no device synchronisation. short_queries=False:
    the CPU kernel takes the short ones, plan only the prefill chunks. kernel_all: the CPU
    kernel takes every request, nothing to plan. sliding_window > 0: a query at p sees keys
    in (p - sliding_window, p]."""
    qsl = meta.query_start_loc_np
    seq_lens = meta.seq_lens_np
    num_reqs = len(seq_lens)
    window = sliding_window
    if kernel_all:
        return AttentionPlan(int(qsl[num_reqs]), None, [], scratch,
                             kernel_max_query_len=KERNEL_ANY_LENGTH, sliding_window=window)
    query_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
    short = (query_lens >= 1) & (query_lens <= MAX_BATCHED_QUERY)
    decode_reqs = np.flatnonzero(short) if short_queries else np.zeros(0, dtype=np.int64)
    short_queries_plan = None
    if len(decode_reqs):
        n_blocks = -(-int(seq_lens[decode_reqs].max()) // block_size)
        rows = torch.from_numpy(decode_reqs.astype(np.int64)).to(device)
        blocks = meta.block_table[rows, :n_blocks].long()
        lens = meta.seq_lens[rows].to(torch.int64)
        keys = torch.arange(n_blocks * block_size, device=device)
        qlens_np = query_lens[decode_reqs]
        q_max = int(qlens_np.max())
        valid = None
        if q_max == 1:
            allowed = keys.unsqueeze(0) < lens[:, None]
            if window:  # the query at len - 1 sees keys from len - window on
                allowed &= keys.unsqueeze(0) >= lens[:, None] - window
            allowed = allowed.unsqueeze(1)
            tok_np = qsl[decode_reqs][:, None]
        else:
            # query j of request d sits at position len_d - q_d + j and sees keys up to it
            j = np.arange(q_max)
            tok_np = qsl[decode_reqs][:, None] + np.minimum(j, qlens_np[:, None] - 1)
            qlens = torch.from_numpy(qlens_np.astype(np.int64)).to(device)
            jt = torch.from_numpy(j).to(device)
            q_pos = lens[:, None] - qlens[:, None] + jt[None, :]
            allowed = keys[None, None, :] <= q_pos[:, :, None]
            if window:
                allowed &= keys[None, None, :] > q_pos[:, :, None] - window
            if not (qlens_np == q_max).all():
                valid = torch.from_numpy(j[None, :] < qlens_np[:, None]).to(device)
        # Pure decode batches (the steady state) need no gather/scatter of q and out.
        tok = None
        if not (q_max == 1 and len(decode_reqs) == num_reqs and tok_np[-1, 0] == num_reqs - 1):
            tok = torch.from_numpy(tok_np.astype(np.int64)).to(device)
        short_queries_plan = ShortQueries(blocks, allowed, tok, valid)
    prefills = []
    for i in np.flatnonzero(~short & (query_lens > 0)):
        start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        n_blocks = -(-seq_len // block_size)
        # with a window, keys before the first query's window are never read: start at the
        # block of the first visible key, and count key positions from there
        first = max(0, seq_len - (end - start) - window + 1) // block_size if window else 0
        k0 = first * block_size
        # Query j sits at absolute position seq_len - L + j and sees keys up to that position.
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=device).unsqueeze(1)
        key_pos = torch.arange(k0, seq_len, device=device).unsqueeze(0)
        mask = key_pos <= q_pos
        if window:
            mask &= key_pos > q_pos - window
        prefills.append(Prefill(start, end,
                                 meta.block_table[int(i), first:n_blocks].long()[None],
                                 seq_len - k0, mask.unsqueeze(0)))
    kernel_max = MAX_BATCHED_QUERY if not short_queries and short.any() else 0
    return AttentionPlan(int(qsl[num_reqs]), short_queries_plan, prefills, scratch,
                         kernel_max_query_len=kernel_max, sliding_window=window)


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Same contract as _attend; allowed None means plain causal with L == S."""
    out = F.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=None if allowed is None else allowed.unsqueeze(1), is_causal=allowed is None,
        scale=scale, enable_gqa=True)
    return out.transpose(1, 2).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    plan: AttentionPlan | None = None) -> torch.Tensor:
    """q [T, H, hd] for the new tokens (their K/V already written) -> [T, H, hd]."""
    if plan is None:
        plan = plan_attention(meta, k_cache.shape[1], q.device)
    out = torch.empty_like(q)
    if q.shape[0] > plan.num_tokens:  # padding tokens (fixed-size batches) belong to nobody
        out[plan.num_tokens :] = 0
    attend_planned(out, q, k_cache, v_cache, plan, scale, plan.prefills)
    return out


def attend_planned(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, plan: AttentionPlan, scale: float,
                   prefills: list[Prefill]) -> None:
    """Fill out's rows for the plan's batched short queries and the given prefill chunks,
    gathering each one's context from the cache."""
    attend = _attend_sdpa if USE_SDPA else _attend
    sq = plan.short
    if sq is not None:
        k = _gather_context(k_cache, sq.blocks, plan.scratch, 0)  # [D, S, KVH, hd]
        v = _gather_context(v_cache, sq.blocks, plan.scratch, 1)
        if sq.tok is None:
            d = sq.blocks.shape[0]
            out[:d] = attend(q[:d].unsqueeze(1), k, v, sq.allowed, scale).squeeze(1)
        else:
            tok = sq.tok
            o = attend(q[tok], k, v, sq.allowed, scale)  # [D, Q, H, hd]
            if sq.valid is None:
                out[tok.reshape(-1)] = o.reshape(-1, *o.shape[2:])
            else:  # padded queries repeat a real token: write only the real ones
                out[tok[sq.valid]] = o[sq.valid]
    for p in prefills:
        k = _gather_context(k_cache, p.blocks, plan.scratch, 0)[:, : p.seq_len]
        v = _gather_context(v_cache, p.blocks, plan.scratch, 1)[:, : p.seq_len]
        qp = q[p.start : p.end].unsqueeze(0)
        if USE_SDPA:
            # Without cached context or a window the mask is plain causal: let the kernel skip
            # masked tiles.
            plain = p.seq_len == p.end - p.start and not plan.sliding_window
            mask = None if plain else p.allowed
            out[p.start : p.end] = _attend_sdpa(qp, k, v, mask, scale)[0]
        else:
            out[p.start : p.end] = _attend(qp, k, v, p.allowed, scale)[0]
