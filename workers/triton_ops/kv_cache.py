"""Rotary embedding and the KV-cache write in one Triton pass.

The fused projection output qkv [T, (H + 2 * KVH) * hd] is rotated in place (q and k heads,
rotate-half layout with float32 cos/sin tables, as RotaryEmbedding.forward_torch), and each
token's rotated K and its V are stored in its cache slot (slot_mapping: block * block_size +
offset). A slot < 0 marks a padding token (a CUDA-graph batch padded to its captured size):
it writes nowhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.triton_ops import next_pow2


@triton.jit
def _rotary_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_cos, stride_c_blk, stride_c_slot, stride_c_head,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROTATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads first, then k heads
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_P)
    ok = offs < half
    base = qkv_ptr + t * stride_qkv + h * HEAD_DIM
    x1 = tl.load(base + offs, mask=ok, other=0.0)
    x2 = tl.load(base + half + offs, mask=ok, other=0.0)
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=ok, other=0.0)
        sin = tl.load(sin_ptr + pos * stride_cos + offs, mask=ok, other=0.0)
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        x1 = (a * cos - b * sin).to(qkv_ptr.dtype.element_ty)
        x2 = (b * cos + a * sin).to(qkv_ptr.dtype.element_ty)
        tl.store(base + offs, x1, mask=ok)
        tl.store(base + half + offs, x2, mask=ok)
    if h >= Q_HEADS:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            kv_head = h - Q_HEADS
            dst = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot \
                + kv_head * stride_c_head
            cdt = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst + offs, x1.to(cdt), mask=ok)
            tl.store(k_cache_ptr + dst + half + offs, x2.to(cdt), mask=ok)
            vsrc = qkv_ptr + t * stride_qkv + (Q_HEADS + KV_HEADS + kv_head) * HEAD_DIM
            v1 = tl.load(vsrc + offs, mask=ok, other=0.0)
            v2 = tl.load(vsrc + half + offs, mask=ok, other=0.0)
            tl.store(v_cache_ptr + dst + offs, v1.to(cdt), mask=ok)
            tl.store(v_cache_ptr + dst + half + offs, v2.to(cdt), mask=ok)


def rotary_kv_(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int,
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
               rotate: bool = True) -> None:
    """Rotate q and k of qkv [T, >= (q_heads + 2 * kv_heads) * head_dim] in place and write
    K/V into the caches [blocks, block_size, kv_heads, head_dim]; rotate=False only writes."""
    num_tokens = qkv.shape[0]
    if num_tokens == 0:
        return
    assert head_dim % 2 == 0 and qkv.stride(1) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride() and cos.stride() == sin.stride()
    _rotary_kv_kernel[(num_tokens, q_heads + kv_heads)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        HALF_P=next_pow2(head_dim // 2), BLOCK_SIZE=k_cache.shape[1], ROTATE=rotate,
    )
