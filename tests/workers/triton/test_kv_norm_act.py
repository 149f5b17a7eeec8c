"""The Triton rotary + KV-write, RMSNorm and SiLU-and-mul kernels against the torch paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.workers.triton.common import DEVICE
from workers.attention import reference
from workers.model.layers import RMSNorm, RotaryEmbedding
from workers.triton_ops import kv_cache, norm_act

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The kernels round where the torch path rounds. fp16 then matches to one unit in the last
# place; bf16 gets a few, because the interpreter (numpy has no bf16) truncates float32 to bf16
# where a GPU rounds to nearest, and a kernel rounds twice (norm, then times the weight).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2**-5, torch.float16: 2**-10}


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), ref.float(), rtol=RTOL[dtype], atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [32, 20])  # 20: half a head is not a power of two
def test_rotary_kv_rotates_and_fills_the_cache(dtype, hd):
    qh, kvh, n = 4, 2, 9
    rope = RotaryEmbedding(hd, 256, 10000.0, None, DEVICE)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(n, (qh + 2 * kvh) * hd + 8, generator=g).to(dtype).to(DEVICE)
    qkv = wide[:, :-8]  # rows of a wider buffer, as views of a projection are
    pos = torch.randint(0, 256, (n,), generator=g).to(DEVICE)
    slots = torch.randperm(6 * 4, generator=g)[:n].to(DEVICE)
    slots[4] = -1  # a padding token: writes nowhere
    k_ref = torch.randn(6, 4, kvh, hd, generator=g).to(dtype).to(DEVICE)
    v_ref = torch.randn(6, 4, kvh, hd, generator=g).to(dtype).to(DEVICE)
    k_got, v_got = k_ref.clone(), v_ref.clone()
    q, k, v = qkv.split([qh * hd, kvh * hd, kvh * hd], dim=-1)
    q_ref = rope.forward_torch(pos, q.reshape(n, qh, hd))
    k_rot = rope.forward_torch(pos, k.reshape(n, kvh, hd))
    real = slots >= 0
    reference.write_kv(k_rot[real], v.reshape(n, kvh, hd)[real], k_ref, v_ref, slots[real])
    got = wide.clone()[:, :-8]
    kv_cache.rotary_kv_(got, qh, kvh, hd, pos, rope.cos, rope.sin, k_got, v_got, slots)
    assert_close(got[:, : qh * hd].reshape(n, qh, hd), q_ref, dtype)
    assert_close(got[:, qh * hd : (qh + kvh) * hd].reshape(n, kvh, hd), k_rot, dtype)
    assert torch.equal(got[:, (qh + kvh) * hd :], qkv[:, (qh + kvh) * hd :])
    assert_close(k_got, k_ref, dtype)
    assert torch.equal(v_got, v_ref)


def test_write_only_leaves_qkv_alone():
    qkv = torch.randn(5, 4 * 16).to(DEVICE)
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 1, 2, 5, 7], device=DEVICE)
    cos = torch.ones(8, 8, device=DEVICE)
    before = qkv.clone()
    kv_cache.rotary_kv_(qkv, 2, 1, 16, torch.zeros(5, dtype=torch.long, device=DEVICE), cos,
                        cos, k_cache, v_cache, slots, rotate=False)
    assert torch.equal(qkv, before)
    flat_k = k_cache.view(-1, 16)
    assert torch.equal(flat_k[slots], qkv[:, 32:48])
    assert torch.equal(v_cache.view(-1, 16)[slots], qkv[:, 48:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [96, 100])
def test_rms_norm_and_fused_residual(dtype, dim):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(dim, 1e-5, dtype, DEVICE)
    norm.weight.copy_(torch.randn(dim, generator=g))
    x = torch.randn(13, dim, generator=g).to(dtype).to(DEVICE)
    delta = torch.randn(13, dim, generator=g).to(dtype).to(DEVICE)
    assert_close(norm_act.rms_norm(x.clone(), norm.weight, 1e-5), norm.forward_torch(x), dtype)
    h = x.clone()
    got = norm_act.rms_norm(h, norm.weight, 1e-5, residual=delta)
    assert_close(h, x + delta, dtype)  # the residual stream is updated in place
    assert_close(got, norm.forward_torch(x + delta), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 1500])  # 1500: two column blocks, a ragged tail
def test_silu_and_mul(dtype, cols):
    x = torch.randn(7, 2 * cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = x.to(DEVICE)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert_close(norm_act.silu_and_mul(x), ref, dtype)
