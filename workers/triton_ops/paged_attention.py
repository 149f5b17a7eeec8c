"""Paged attention in one Triton launch per layer for a whole mixed step.

Prefill chunks continuing from cached context, fresh prefills, prefix-cache hits, decodes and a
token plus its drafts are all the same thing here: request r has q_len new tokens at the end of
seq_len tokens, and its query j (absolute position seq_len - q_len + j) sees keys 0..that
position. K/V are read straight from the block cache through the block table.

Work split: one program per (query block, KV head). A query block is BLOCK_Q consecutive new
tokens of one request times the GROUP query heads that share the KV head, BLOCK_M = BLOCK_Q *
GROUP rows, so every K/V tile loaded serves the whole group. Query blocks never straddle two
requests; request r's blocks are numbered from qsl[r] // BLOCK_Q + r, so T // BLOCK_Q + R
programs always cover the step, and the grid depends only on the padded token count and the
number of requests (what a CUDA graph needs). Programs past a request's last block return.

Split keys ("segments"): with few requests and long contexts one program per (block, head)
leaves most of the GPU idle, so the key range of each request is cut into NUM_SEGMENTS pieces
done by separate programs, each writing its partial (max, sum, unnormalized output) in float32,
and a second small kernel merges them.

Sliding windows (WINDOW > 0, a constexpr: one compiled variant per window size): query j at
position p sees keys in (p - WINDOW, p]. The key loop starts at the block's first visible key
(its first query's lower bound), so key tiles wholly below the window are never loaded, and
each row masks the keys below its own bound. Blocks before the window may already be back in
the pool (the null block stands in the table), which is why they must not be read.

Math: bf16/fp16 (or float32) in, float32 scores, softmax and accumulation; the softmax runs in
base 2 with log2(e) folded into the scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.triton_ops import interpreting, next_pow2
from workers.triton_ops.attention_config import AttentionConfig, attention_config

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(qsl_ptr, block_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning global query block block_idx: the last r with
    qsl[r] // BLOCK_Q + r <= block_idx (binary search; qsl is non-decreasing)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_reqs,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, WINDOW: tl.constexpr,
):
    block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    req = _find_request(qsl_ptr, block_idx, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    q_block = block_idx - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_P)
    q_pos = q_block * BLOCK_Q + offs_m // GROUP  # index among this request's new tokens
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:  # the interpreter cannot multiply bf16 (numpy has no such type)
        q = q.to(tl.float32)
    key_limit = context + q_pos  # the last key each row may see

    # Keys past the block's last query are never visible: the loop stops there (causal skip).
    key_end = context + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    # With a window, keys below the block's first query's window are never visible: the loop
    # starts at that query's first visible key.
    key_start = 0
    if WINDOW > 0:
        key_start = tl.maximum(context + q_block * BLOCK_Q - WINDOW + 1, 0)
    if NUM_SEGMENTS == 1:
        key_lo = key_start
        key_hi = key_end
    else:
        seg_len = tl.cdiv(tl.cdiv(key_end - key_start, NUM_SEGMENTS), BLOCK_N) * BLOCK_N
        key_lo = key_start + segment * seg_len
        key_hi = tl.minimum(key_end, key_lo + seg_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # The block ids of tile i + 1 are read during tile i and carried in a register: the K/V
    # loads then depend on no load of their own iteration, which is what lets Triton's
    # pipeliner keep the next tiles' K/V copies in flight (num_stages - 1 buffers) while this
    # tile's dots run. With the lookup in the same iteration it waits on every copy at the top.
    offs_t = tl.arange(0, BLOCK_N)
    blk_next = tl.load(bt_row + (key_lo + offs_t) // BLOCK_SIZE,
                       mask=key_lo + offs_t < key_hi, other=0)
    for start in range(key_lo, key_hi, BLOCK_N):
        offs_n = start + offs_t
        n_ok = offs_n < key_hi
        blk = blk_next.to(tl.int64)
        nxt = offs_n + BLOCK_N
        blk_next = tl.load(bt_row + nxt // BLOCK_SIZE, mask=nxt < key_hi, other=0)
        kv_off = blk * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_slot \
            + kv_head * stride_c_head
        k = tl.load(k_cache_ptr + kv_off[None, :] + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2
        visible = row_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= key_limit[:, None])
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > key_limit[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps max -inf; subtract 0 instead (no nan).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        # P is rounded to the cache dtype for the tensor-core product, as on the GPU.
        p_in = p.to(v.dtype)
        if UPCAST:
            p_in = p_in.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p_in, v, input_precision="ieee")
        else:
            pv = tl.dot(p_in, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h
                 + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partials indexed [token, head, segment]; empty segments store max -inf and sum 0.
        part = (token * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc,
                 mask=row_ok[:, None])


@triton.jit
def _merge_segments_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, qsl_ptr, num_reqs,
    stride_o_t, stride_o_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(qsl_ptr + num_reqs):
        return  # a padding token: belongs to no request, its partials were never written
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    part = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS + offs_s
    m = tl.load(part_max_ptr + part)
    m_all = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    total = tl.sum(tl.load(part_sum_ptr + part) * w, 0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def block_m_for(group: int, max_query_len: int) -> int:
    """Rows per program: 16 (tl.dot's minimum) holds a decode's whole query group; longer
    queries get 64 rows so each K/V tile is reused by more queries."""
    base = max(16, next_pow2(group))
    if max_query_len * group > base:
        return max(base, 64)
    return base


def is_decode_block(group: int, block_m: int) -> bool:
    """block_m is the narrow decode width for this group (a query block of one token), the
    attention config's decode rows."""
    return block_m == max(16, next_pow2(group))


def partials(num_tokens: int, num_heads: int, head_dim: int, num_segments: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scratch for the split-key partials of one step (shared by every layer)."""
    hd_p = max(16, next_pow2(head_dim))
    shape = (num_tokens, num_heads, num_segments)
    return (torch.empty(*shape, hd_p, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device))


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, block_m: int,
                    num_segments: int = 1,
                    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    config: AttentionConfig | None = None, sliding_window: int = 0) -> None:
    """out[T, H, hd] = attention of q[T, H, hd] (rows may be strided views) over the paged
    caches [blocks, block_size, KVH, hd]. block_table [R, W] int32, seq_lens [R] int32,
    query_start_loc [R+1] int32; rows of out past query_start_loc[R] are not written.
    sliding_window > 0: a query at position p sees only the keys in (p - sliding_window, p].
    config: tile and launch constants (workers/triton_ops/attention_config.py); default the
    table's row for this head dim and dtype with no GPU architecture.

    Nothing here reads device memory on the host, so it can be captured in a CUDA graph.
    """
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    assert q.stride(2) == 1 and out.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride() and block_table.stride(1) == 1
    block_q = block_m // group
    grid = (num_tokens // block_q + num_reqs, kv_heads, num_segments)
    if num_segments > 1:
        if scratch is None:
            scratch = partials(num_tokens, num_heads, head_dim, num_segments, q.device)
        part_out, part_max, part_sum = scratch
    else:
        part_out = part_max = part_sum = out  # unused
    hd_p = max(16, next_pow2(head_dim))
    if config is None:
        config = attention_config(head_dim, str(q.dtype).removeprefix("torch."), 0,
                                  is_decode_block(group, block_m))
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        part_out, part_max, part_sum,
        scale * _LOG2E, num_reqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_P=hd_p, NUM_HEADS=num_heads,
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=config.block_n,
        NUM_SEGMENTS=num_segments, IEEE=q.dtype == torch.float32,
        UPCAST=interpreting() and q.dtype != torch.float32, WINDOW=sliding_window,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_segments > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out, part_out, part_max, part_sum, query_start_loc, num_reqs,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P=hd_p, NUM_HEADS=num_heads, NUM_SEGMENTS=num_segments,
        )
