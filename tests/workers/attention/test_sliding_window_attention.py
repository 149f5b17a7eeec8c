"""Sliding-window attention in the torch reference and the CPU kernels: a query at position p
sees keys in (p - W, p], blocks before the window are never read by the kernels, and the torch
plan gathers prefill context only from the first visible block on."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paged import Seq, build_step
from tests.helpers.windowed import (
    dense_windowed_attention,
    drop_out_of_window_blocks,
    poison_null_block,
)
from workers import cpu_ops
from workers.attention import reference
from workers.attention.backends.torch import TorchAttentionBackend

# fresh prefill, continued chunk, decodes (short and long), drafts, prefix-hit decode, a chunk
# after 16 cached tokens, a prompt shorter than the window
LAYOUT = [(37, 0), (50, 21), (19, 18), (70, 69), (33, 28), (9, 8), (40, 16), (3, 0)]


def _step(block_size: int, dtype: torch.dtype, heads: int = 6, kv_heads: int = 2,
          hd: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seqs, new, next_block = [], [], 1
    for total, computed in LAYOUT:
        n = -(-total // block_size)
        seqs.append(Seq([0] * total, list(range(next_block, next_block + n))[::-1], computed))
        next_block += n
        new.append(total - computed)
    _, _, meta = build_step(seqs, new, block_size)
    shape = (next_block, block_size, kv_heads, hd)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(int(meta.query_start_loc_np[-1]), heads, hd, generator=g).to(dtype)
    return meta, q, k_cache, v_cache


@pytest.mark.parametrize("window", [1, 5, 8, 13, 1000])
@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_reference_matches_the_definition(window: int, block_size: int) -> None:
    meta, q, k_cache, v_cache = _step(block_size, torch.float32)
    ref = dense_windowed_attention(q, k_cache, v_cache, meta, 0.3, window)
    # out-of-window blocks replaced by a (finite) poisoned null block: masked, never weighted
    windowed = drop_out_of_window_blocks(meta, block_size, window)
    poison_null_block(k_cache, v_cache, 1e4)
    plan = TorchAttentionBackend().begin(windowed, block_size, torch.device("cpu"), window).plan
    out = reference.paged_attention(q, k_cache, v_cache, windowed, 0.3, plan)
    assert (out - ref).abs().max().item() < 1e-5
    # prefill chunks gather from the block of their first visible key on
    for p in plan.prefills:
        assert p.seq_len <= (p.end - p.start) + window + block_size - 2


@pytest.mark.skipif(cpu_ops.ops() is None, reason="the C++ kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 6, 8, 13])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("hd", [32, 24])  # AVX-512 tiles (where present) and the portable path
def test_cpu_kernel_matches_the_definition(dtype, window: int, block_size: int, hd: int) -> None:
    meta, q, k_cache, v_cache = _step(block_size, dtype, hd=hd)
    ref = dense_windowed_attention(q, k_cache, v_cache, meta, 0.3, window)
    # NaN in the null block: a kernel that read a block before the window would show it
    windowed = drop_out_of_window_blocks(meta, block_size, window)
    poison_null_block(k_cache, v_cache, float("nan"))
    out = torch.full_like(q, float("nan"))
    cpu_ops.paged_attention(out, q, k_cache, v_cache, windowed.block_table, windowed.seq_lens,
                            windowed.query_start_loc, len(windowed.seq_lens_np), 0.3,
                            sliding_window=window)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert (out.float() - ref).abs().max().item() < tol
