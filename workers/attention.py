"""Paged attention in portable torch: new K/V go into the block cache through the slot mapping,
then every query reads its context through its block-table row.

One step may mix prefill chunks (continuing from cached context), prefix-cache hits and decodes.
Decodes (one new token) are computed together in one batched gather; prefill chunks loop per
request, which costs little next to their own matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] flattened over (block, offset): [B, n_blocks * block_size, kv_heads, hd].

    blocks [B, n_blocks]. index_select over whole blocks (contiguous rows) is several times
    faster than advanced indexing of the 4-d cache.
    """
    num_blocks, block_size, kv_heads, hd = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, blocks.reshape(-1))
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


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, hd] for the new tokens (their K/V already written) -> [T, H, hd]."""
    out = torch.empty_like(q)
    qsl = meta.query_start_loc_np
    seq_lens = meta.seq_lens_np
    num_reqs = len(seq_lens)
    if q.shape[0] > qsl[num_reqs]:  # padding tokens (fixed-size batches) belong to nobody
        out[int(qsl[num_reqs]) :] = 0
    query_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
    block_size = k_cache.shape[1]
    device = q.device

    decode_reqs = np.flatnonzero(query_lens == 1)
    if len(decode_reqs):
        d_seq = seq_lens[decode_reqs]
        n_blocks = -(-int(d_seq.max()) // block_size)
        tok = torch.from_numpy(qsl[decode_reqs].astype(np.int64)).to(device)
        rows = torch.from_numpy(decode_reqs.astype(np.int64)).to(device)
        blocks = meta.block_table[rows, :n_blocks].long()  # [D, n_blocks]
        k = _gather_context(k_cache, blocks)  # [D, S, KVH, hd]
        v = _gather_context(v_cache, blocks)
        lens = meta.seq_lens[rows].to(torch.int64)
        allowed = torch.arange(k.shape[1], device=device).unsqueeze(0) < lens.unsqueeze(1)
        out[tok] = _attend(q[tok].unsqueeze(1), k, v, allowed.unsqueeze(1), scale).squeeze(1)

    for i in np.flatnonzero(query_lens > 1):
        start, end = int(qsl[i]), int(qsl[i + 1])
        seq_len = int(seq_lens[i])
        n_blocks = -(-seq_len // block_size)
        blocks = meta.block_table[int(i), :n_blocks].long()
        k = _gather_context(k_cache, blocks.unsqueeze(0))[:, :seq_len]
        v = _gather_context(v_cache, blocks.unsqueeze(0))[:, :seq_len]
        # Query j sits at absolute position seq_len - L + j and sees keys up to that position.
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=device)
        allowed = torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos.unsqueeze(1)
        out[start:end] = _attend(q[start:end].unsqueeze(0), k, v, allowed.unsqueeze(0), scale)[0]
    return out
