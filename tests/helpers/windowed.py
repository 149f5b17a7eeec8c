"""Sliding-window attention checks shared by the torch/CPU and Triton kernel tests: a dense
reference written from the definition, and a block table with the out-of-window blocks replaced
by a poisoned null block (what the scheduler leaves once a window group gave them back)."""

from __future__ import annotations

from dataclasses import replace

import torch

from workers.attention.reference import AttentionMetadata


def dense_windowed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             meta: AttentionMetadata, scale: float, window: int) -> torch.Tensor:
    """q [T, H, hd] -> [T, H, hd] in float32: query at position p attends to keys in
    (p - window, p] (window 0: every key up to p), as transformers' sliding_window_overlay."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    heads = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    qsl, lens = meta.query_start_loc_np, meta.seq_lens_np
    table = meta.block_table.cpu()
    for r in range(len(lens)):
        seq_len, start, end = int(lens[r]), int(qsl[r]), int(qsl[r + 1])
        keys = torch.arange(seq_len)
        slots = table[r, keys // block_size].long() * block_size + keys % block_size
        k = k_cache.reshape(-1, kv_heads, k_cache.shape[3])[slots].float().cpu()
        v = v_cache.reshape(-1, kv_heads, v_cache.shape[3])[slots].float().cpu()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        for t in range(start, end):
            p = seq_len - (end - start) + (t - start)
            visible = keys <= p
            if window:
                visible &= keys > p - window
            s = torch.einsum("hd,khd->hk", q[t].float().cpu(), k) * scale
            s = s.masked_fill(~visible[None, :], float("-inf"))
            out[t] = torch.einsum("hk,khd->hd", torch.softmax(s, dim=-1), v)
    return out


def drop_out_of_window_blocks(meta: AttentionMetadata, block_size: int,
                              window: int) -> AttentionMetadata:
    """The same step with every block that no query of its request can see replaced by the
    null block 0 in the table."""
    table = meta.block_table.clone()
    qsl, lens = meta.query_start_loc_np, meta.seq_lens_np
    for r in range(len(lens)):
        first_query = int(lens[r]) - int(qsl[r + 1] - qsl[r])
        table[r, : max(0, first_query - window + 1) // block_size] = 0
    return replace(meta, block_table=table)


def poison_null_block(k_cache: torch.Tensor, v_cache: torch.Tensor, value: float) -> None:
    """Fill block 0 (the null block) so that reading it would show in the output."""
    k_cache[0] = value
    v_cache[0] = value
