"""The Triton paged attention kernel against the torch reference (workers/attention/reference.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.workers.triton.common import DEVICE, mixed_step
from workers.attention import reference
from workers.triton_ops import paged_attention as kernels

# float32 inputs take IEEE dot products; bf16/fp16 round P to the cache dtype as on a GPU.
ATOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _run(q, k_cache, v_cache, meta, scale, segments: int, block_m: int | None = None):
    group = q.shape[1] // k_cache.shape[2]
    if block_m is None:
        block_m = kernels.block_m_for(group, meta.max_query_len if segments == 1 else 1)
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(out, q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                            meta.query_start_loc, scale, block_m, segments)
    return out


def _caches(num_blocks, block_size, kv_heads, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, hd)
    return (torch.randn(shape, generator=g).to(dtype).to(DEVICE),
            torch.randn(shape, generator=g).to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(8, 4, 32), (9, 3, 64), (5, 1, 16), (4, 4, 48)])
def test_mixed_step_matches_reference(dtype, block_size, heads, kv_heads, hd):
    """Fresh prefill, continued chunks, decodes, drafts and a prefix hit in one launch; GQA
    groups of 1, 2, 3 and 5; a head dim that is not a power of two."""
    meta, num_blocks = mixed_step(block_size)
    k_cache, v_cache = _caches(num_blocks, block_size, kv_heads, hd, dtype)
    t = int(meta.query_start_loc_np[-1])
    q = torch.randn(t, heads, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    q = q.to(DEVICE)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, hd**-0.5)
    out = _run(q, k_cache, v_cache, meta, hd**-0.5, segments=1)
    assert (out.float() - ref.float()).abs().max().item() < ATOL[dtype]


@pytest.mark.parametrize("segments", [2, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_keys_match_reference(segments, dtype):
    """Decodes and drafts with the key range split into segments and merged; 16 segments leave
    some empty for the short contexts."""
    layout = [(70, 69), (19, 18), (33, 28), (5, 4), (1, 0)]
    meta, num_blocks = mixed_step(4, layout)
    k_cache, v_cache = _caches(num_blocks, 4, 2, 32, dtype)
    t = int(meta.query_start_loc_np[-1])
    q = torch.randn(t, 6, 32, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, 0.2)
    out = _run(q, k_cache, v_cache, meta, 0.2, segments=segments)
    assert (out.float() - ref.float()).abs().max().item() < ATOL[dtype]


def test_wide_query_blocks_match_reference():
    """64-row query blocks (the prefill tiling) on the same mixed step."""
    meta, num_blocks = mixed_step(16)
    k_cache, v_cache = _caches(num_blocks, 16, 2, 32, torch.float32)
    t = int(meta.query_start_loc_np[-1])
    q = torch.randn(t, 4, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = reference.paged_attention(q, k_cache, v_cache, meta, 0.2)
    out = _run(q, k_cache, v_cache, meta, 0.2, segments=1, block_m=64)
    assert (out - ref).abs().max().item() < 1e-5


def test_strided_queries_from_the_fused_projection():
    """q as a view into qkv rows (what the backend passes), output rows of another stride."""
    meta, num_blocks = mixed_step(4)
    heads, kvh, hd = 4, 2, 16
    k_cache, v_cache = _caches(num_blocks, 4, kvh, hd, torch.float32)
    t = int(meta.query_start_loc_np[-1])
    qkv = torch.randn(t, (heads + 2 * kvh) * hd, generator=torch.Generator().manual_seed(4))
    q = qkv.to(DEVICE)[:, : heads * hd].view(t, heads, hd)
    ref = reference.paged_attention(q.contiguous(), k_cache, v_cache, meta, 0.25)
    out = _run(q, k_cache, v_cache, meta, 0.25, segments=1)
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("segments", [1, 4])
def test_padding_requests_and_tokens_are_ignored(segments):
    """A CUDA-graph batch: 3 real decodes padded to 8 requests / 8 tokens. Padding requests
    have no tokens (query_start_loc stays at 3) and no context; padding token rows are left
    untouched, real rows equal the unpadded step."""
    layout = [(21, 20), (9, 8), (40, 39)]
    meta, num_blocks = mixed_step(4, layout)
    k_cache, v_cache = _caches(num_blocks, 4, 2, 16, torch.float32)
    q = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ref = _run(q[:3], k_cache, v_cache, meta, 0.25, segments)
    qsl = torch.tensor([0, 1, 2, 3, 3, 3, 3, 3, 3], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    seq_lens[:3] = meta.seq_lens
    table = torch.zeros(8, meta.block_table.shape[1], dtype=torch.int32, device=DEVICE)
    table[:3] = meta.block_table
    out = torch.full_like(q, 7.0)
    kernels.paged_attention(out, q, k_cache, v_cache, table, seq_lens, qsl, 0.25,
                            kernels.block_m_for(2, 1), segments)
    assert torch.equal(out[:3], ref)
    assert bool((out[3:] == 7.0).all())


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("window", [1, 6, 13, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_the_definition(segments, window, dtype):
    """WINDOW: each query sees keys in (p - W, p]; key tiles before the block's first visible
    key are skipped, so a NaN-filled null block standing in for every out-of-window block is
    never read (mixed step: prefills, chunks, decodes, drafts, split keys)."""
    from tests.helpers.windowed import (
        dense_windowed_attention,
        drop_out_of_window_blocks,
        poison_null_block,
    )

    block_size = 4
    meta, num_blocks = mixed_step(block_size)
    k_cache, v_cache = _caches(num_blocks, block_size, 2, 32, dtype)
    t = int(meta.query_start_loc_np[-1])
    q = torch.randn(t, 6, 32, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    ref = dense_windowed_attention(q, k_cache, v_cache, meta, 0.2, window)
    windowed = drop_out_of_window_blocks(meta, block_size, window)
    poison_null_block(k_cache, v_cache, float("nan"))
    group = 3
    block_m = kernels.block_m_for(group, meta.max_query_len)
    if segments > 1:  # split keys need single-block queries: decodes only
        block_m = kernels.block_m_for(group, 1)
        keep = [i for i in range(len(meta.seq_lens_np))
                if meta.query_start_loc_np[i + 1] - meta.query_start_loc_np[i] == 1]
        assert keep
    out = torch.full_like(q, float("nan"))
    kernels.paged_attention(out, q, k_cache, v_cache, windowed.block_table, windowed.seq_lens,
                            windowed.query_start_loc, 0.2, block_m, segments,
                            sliding_window=window)
    if segments > 1:
        rows = [int(meta.query_start_loc_np[i]) for i in keep]
        out, ref = out[rows], ref[rows]
    assert (out.float().cpu() - ref).abs().max().item() < ATOL[dtype]
