"""CPU kernels (workers/cpu_ops/csrc/) against the torch path they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.paged import Seq, mixed_step
from workers import cpu_ops
from workers.attention import reference
from workers.model.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_ops.ops() is None, reason="no C++ compiler: kernels off")

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
# bf16 inputs are identical on both paths; the kernel accumulates in float32 in another order.
ATOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _mixed_step(block_size: int):
    """One step holding a fresh prefill, a chunk continuing cached context, decodes, a request
    verifying 4 drafts and a prefix-cache hit, with scattered block ids."""
    return mixed_step(block_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(8, 4, 32), (6, 6, 32), (6, 1, 32), (5, 1, 32),
                                               (4, 2, 64), (9, 3, 64), (2, 1, 128), (4, 2, 48)])
def test_paged_attention_matches_torch(dtype, block_size, heads, kv_heads, hd, monkeypatch):
    """Head dims 32/64/128 take the AVX-512 paths where built (query tiles for the chunks of
    more than 3 tokens; decodes take a KV head's query heads in chunks of up to 4, so groups
    of 1 to 6 cover every chunk size), 48 the portable one."""
    meta, num_blocks = _mixed_step(block_size)
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, kv_heads, hd)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    t = int(meta.query_start_loc_np[-1])
    q = torch.randn(t, heads, hd, generator=g).to(dtype)
    with monkeypatch.context() as m:  # the reference must not route through the kernel
        m.setattr(cpu_ops, "ENABLED", False)
        ref = reference.paged_attention(q, k_cache, v_cache, meta, hd**-0.5)
    out = torch.full_like(q, float("nan"))
    cpu_ops.paged_attention(out, q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                            meta.query_start_loc, len(meta.seq_lens_np), hd**-0.5)
    assert (out.float() - ref.float()).abs().max().item() < ATOL[dtype]


def test_paged_attention_reads_strided_queries(monkeypatch):
    """q as a view into the fused qkv projection output (rows wider than heads * hd)."""
    meta, num_blocks = _mixed_step(4)
    hd, heads, kvh = 16, 4, 2
    k_cache = torch.randn(num_blocks, 4, kvh, hd)
    v_cache = torch.randn(num_blocks, 4, kvh, hd)
    t = int(meta.query_start_loc_np[-1])
    qkv = torch.randn(t, (heads + 2 * kvh) * hd)
    q = qkv[:, : heads * hd].view(t, heads, hd)
    with monkeypatch.context() as m:
        m.setattr(cpu_ops, "ENABLED", False)
        ref = reference.paged_attention(q.contiguous(), k_cache, v_cache, meta, 0.25)
    out = torch.empty(t, heads, hd)
    cpu_ops.paged_attention(out, q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                            meta.query_start_loc, len(meta.seq_lens_np), 0.25)
    assert (out - ref).abs().max().item() < 2e-6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [96, 100])  # 100: 16-lane blocks and a scalar tail
def test_rms_norm_and_fused_residual(dtype, dim):
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(dim, 1e-5, dtype, CPU)
    norm.weight.copy_(torch.randn(dim, generator=g))
    x = torch.randn(13, dim, generator=g).to(dtype)
    delta = torch.randn(13, dim, generator=g).to(dtype)
    ref = norm.forward_torch(x)
    assert (cpu_ops.rms_norm(x.clone(), norm.weight, 1e-5).float() - ref.float()).abs().max() < 1e-5
    h = x.clone()
    got = cpu_ops.rms_norm(h, norm.weight, 1e-5, residual=delta)
    assert torch.equal(h, x + delta)  # the residual stream is updated in place
    assert (got.float() - norm.forward_torch(x + delta).float()).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [32, 20])  # 20: the scalar loop (half a head is not 16 lanes)
def test_rotary_in_place_on_leading_heads(dtype, hd):
    rope = RotaryEmbedding(hd, 256, 10000.0, None, CPU)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(11, 7 * hd, generator=g).to(dtype)  # 5 heads rotated, 2 left alone
    pos = torch.randint(0, 256, (11,), generator=g)
    ref = rope.forward_torch(pos, qkv[:, : 5 * hd].reshape(11, 5, hd))
    got = qkv.clone()
    cpu_ops.rotary_(got, 5, hd, pos, rope.cos, rope.sin)
    assert torch.equal(got[:, 5 * hd :], qkv[:, 5 * hd :])
    assert (got[:, : 5 * hd].reshape(11, 5, hd).float() - ref.float()).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hd", [32, 20])
def test_rotary_kv_rotates_and_fills_the_cache(dtype, hd):
    """The fused kernel equals torch rotary on q and k plus write_kv, slots in any order."""
    qh, kvh, n = 4, 2, 9
    rope = RotaryEmbedding(hd, 256, 10000.0, None, CPU)
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(n, (qh + 2 * kvh) * hd + 8, generator=g).to(dtype)
    qkv = wide[:, :-8]  # rows of a wider buffer, as the fused projection's views are
    pos = torch.randint(0, 256, (n,), generator=g)
    slots = torch.randperm(6 * 4, generator=g)[:n]
    k_ref = torch.randn(6, 4, kvh, hd, generator=g).to(dtype)
    v_ref = torch.randn(6, 4, kvh, hd, generator=g).to(dtype)
    k_got, v_got = k_ref.clone(), v_ref.clone()
    q, k, v = qkv.split([qh * hd, kvh * hd, kvh * hd], dim=-1)
    q_ref = rope.forward_torch(pos, q.reshape(n, qh, hd))
    k_rot = rope.forward_torch(pos, k.reshape(n, kvh, hd))
    reference.write_kv(k_rot, v.reshape(n, kvh, hd), k_ref, v_ref, slots)
    got = wide.clone()[:, :-8]
    cpu_ops.rotary_kv_(got, qh, kvh, hd, pos, rope.cos, rope.sin, k_got, v_got, slots)
    assert (got[:, : qh * hd].reshape(n, qh, hd).float() - q_ref.float()).abs().max() < 1e-5
    assert (got[:, qh * hd : (qh + kvh) * hd].reshape(n, kvh, hd).float()
            - k_rot.float()).abs().max() < 1e-5
    assert torch.equal(got[:, (qh + kvh) * hd :], qkv[:, (qh + kvh) * hd :])
    assert (k_got.float() - k_ref.float()).abs().max() < 1e-5
    assert torch.equal(v_got, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = (torch.randn(9, 2 * 50) * 8).to(dtype)
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -1e-3])
    ref = F.silu(x[:, :50].float()) * x[:, 50:].float()
    got = cpu_ops.silu_and_mul(x).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got - ref).abs() <= tol * (1 + ref.abs())).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_takes_the_lowest_tied_index_within_cols(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1000, generator=g).to(dtype)
    x[1, 7] = x[1, 600] = 50.0  # tie: lowest index wins, as torch.argmax
    x[2, 999] = 60.0  # past `cols`: ignored
    x[3, :] = -1.0  # all equal
    val, idx = cpu_ops.argmax(x, cols=990)
    ref_val, ref_idx = x[:, :990].float().max(dim=-1)
    assert idx.tolist() == x[:, :990].float().argmax(-1).tolist()
    assert idx[1] == 7 and idx[3] == 0
    assert torch.equal(val, ref_val)
    assert np.array_equal(idx.numpy(), ref_idx.numpy())


def _bitmasks(rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Masks of every kind a grammar makes: all allowed, few allowed, random, none allowed."""
    words = -(-vocab // 32)
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    bm[0] = -1
    bm[1] = 0
    bm[1, 3] = (1 << 5) - (1 << 31)  # bits 5 and 31 (sign): tokens 101 and 127
    bm[2] = 0
    bm[3, :-1] = -1  # everything but the last, partial word
    return bm


def test_token_bitmask_matches_xgrammar_and_masked_argmax_matches_masking():
    """The masking kernel equals xgrammar's (the reference the GPU path uses); the masked
    argmax equals masking then torch.argmax, ties to the lowest id, unmasked rows plain."""
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(11)
    vocab = 1000  # not a multiple of 32: the last word is partial
    bm = _bitmasks(6, vocab, g)
    logits = torch.randn(6, vocab + 24, generator=g)[:, :vocab]  # strided rows, like a slice
    logits[1, 101] = logits[1, 127] = 7.0  # a tie among the allowed tokens
    rows = torch.tensor([0, 1, 3, 4, 5])
    ours, ref = logits.clone(), logits.clone()
    cpu_ops.apply_token_bitmask(ours, bm, rows, vocab)
    xgr.apply_token_bitmask_inplace(ref, bm, vocab_size=vocab, indices=rows.tolist())
    assert torch.equal(ours, ref)

    mask_rows = torch.tensor([0, 1, -1, 3, 4, 5])
    greedy = cpu_ops.masked_argmax(logits.contiguous(), bm, mask_rows, vocab)
    assert greedy.tolist() == ref.argmax(-1).tolist()
    assert greedy[1] == 101
    # a row allowing nothing gets token 0 (what argmax over an all -inf row gives)
    assert cpu_ops.masked_argmax(logits.contiguous()[2:3], bm[2:3], torch.tensor([0]),
                                 vocab).tolist() == [0]


needs_bf16_matmul = pytest.mark.skipif(not cpu_ops.bf16_matmul_available(),
                                       reason="the CPU has no AVX512-BF16")


@needs_bf16_matmul
@pytest.mark.parametrize("m,n,k", [(1, 33, 2), (7, 1000, 576), (64, 3000, 256), (13, 16, 64)])
def test_bf16_matmul_logits_and_fused_argmax(m, n, k):
    """Row counts off the 6-row tile, column counts off the 64-column tile; the logits are the
    exact products rounded to bf16, up to float32 summation error; the fused argmax equals
    torch.argmax over the kernel's own logits."""
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = cpu_ops.pack_bf16_pairs(w)
    y, idx, val = cpu_ops.bf16_matmul(x, packed, n, argmax_cols=n)
    assert y is not None and idx is not None and val is not None
    exact = x.double() @ w.double().T
    # bf16 rounding (half a step: 2^-8 relative) plus float32 summation error
    sums = x.double().abs() @ w.double().abs().T
    assert ((y.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-6 * sums).all()
    assert idx.tolist() == y.float().argmax(-1).tolist()
    assert torch.equal(val, y.float().max(-1).values)
    # argmax alone (no logits written), over the first columns only
    none, idx2, _ = cpu_ops.bf16_matmul(x, packed, n, logits=False, argmax_cols=n - n // 3)
    assert none is None and idx2 is not None
    assert idx2.tolist() == y[:, : n - n // 3].float().argmax(-1).tolist()


@needs_bf16_matmul
def test_bf16_matmul_argmax_ties_nan_and_column_ranges():
    """Ties go to the lowest column, across lanes, tiles and threads; a NaN column never wins;
    a column's value does not depend on which other columns are in the call (TP shards)."""
    g = torch.Generator().manual_seed(5)
    n, k = 4000, 128
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(4, k, generator=g).bfloat16()
    big = x[0].float() * 10
    w[3990] = w[17] = w[2100] = big.bfloat16()  # row 0's top column, three times
    w[5] = float("nan")
    y, idx, _ = cpu_ops.bf16_matmul(x, cpu_ops.pack_bf16_pairs(w), n, argmax_cols=n)
    assert y is not None and idx is not None
    assert idx[0] == 17
    assert torch.isnan(y[:, 5]).all() and (idx != 5).all()
    half, idx_half, _ = cpu_ops.bf16_matmul(x, cpu_ops.pack_bf16_pairs(w[2000:].contiguous()),
                                            n - 2000, argmax_cols=n - 2000)
    assert half is not None and idx_half is not None
    assert torch.equal(half, y[:, 2000:]) and idx_half[0] == 2100 - 2000


def test_model_step_with_batched_fresh_prefills_matches_torch_path(monkeypatch):
    """Equal-length fresh prefills (one batched SDPA call on the new K/V), another length and
    a decode in one step: the same logits as with the kernels off."""
    from tests.helpers.paged import run_step
    from workers.model.layers import reselect_kernels
    from workers.model.loader import load_model

    model, _ = load_model("dummy:micro", 0, 1, torch.float32, CPU)
    g = torch.Generator().manual_seed(4)

    def step() -> list[torch.Tensor]:
        model.allocate_kv_cache(64, 4)
        # longer than MAX_BATCHED_QUERY, so these are prefills, not kernel queries
        lens = (20, 20, 20, 18, 5)
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]
        seqs = [Seq(p, list(range(1 + 6 * i, 7 + 6 * i))) for i, p in enumerate(prompts)]
        run_step(model, seqs[4:], [4], 4)  # request 4 decodes its 5th token next step
        return run_step(model, seqs, [20, 20, 20, 18, 1], 4)

    state = g.get_state()
    got = step()
    g.set_state(state)
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    reselect_kernels(model)
    ref = step()
    for a, b in zip(got, ref, strict=True):
        assert (a - b).abs().max().item() < 1e-4
