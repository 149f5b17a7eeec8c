"""Paged attention consistency: chunked prefill, decode and mixed batches agree with one prefill."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paged import Seq, run_step
from workers import cpu_ops
from workers.attention import reference
from workers.model.layers import reselect_kernels
from workers.model.loader import load_model

TOL = 1e-4  # fp32: different matmul shapes round differently


@pytest.fixture(scope="module")
def model():
    m, _ = load_model("dummy:micro", 0, 1, torch.float32, torch.device("cpu"))
    return m


@pytest.fixture(autouse=True, params=["kernels", "sdpa", "reference"])
def attention_path(request, monkeypatch, model):
    """Every test runs on the CPU kernels (SDPA for long prefill chunks), on torch's fused SDPA
    path alone, and on the plain matmul/softmax path."""
    if request.param == "kernels" and cpu_ops.ops() is None:
        pytest.skip("no C++ compiler: kernels off")
    monkeypatch.setattr(cpu_ops, "ENABLED", request.param == "kernels")
    monkeypatch.setattr(reference, "USE_SDPA", request.param != "reference")
    reselect_kernels(model)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def _alone(model, tokens: list[int], block_size: int) -> torch.Tensor:
    """Logits of every position from one fresh full prefill (the reference)."""
    model.allocate_kv_cache(64, block_size)
    n = -(-len(tokens) // block_size)
    return run_step(model, [Seq(tokens, list(range(1, n + 1)))], [len(tokens)], block_size)[0]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_chunked_prefill_and_decode_equal_full_prefill(model, block_size):
    tokens = _prompt(23, 0)
    ref = _alone(model, tokens, block_size)
    # Deliberately scattered, non-monotonic block ids.
    n = -(-len(tokens) // block_size)
    blocks = [63 - 2 * i for i in range(n)]
    for chunks in ([7, 9, 7], [1] * 23, [22, 1]):
        model.allocate_kv_cache(64, block_size)
        seq = Seq(tokens, blocks)
        got = torch.cat([run_step(model, [seq], [c], block_size)[0] for c in chunks])
        assert (got - ref).abs().max().item() < TOL, chunks


def test_mixed_batch_equals_running_alone(model):
    bs = 4
    pa, pb, pc = _prompt(10, 1), _prompt(17, 2), _prompt(14, 3)
    pd = pc[:8] + _prompt(5, 4)  # shares two full blocks with C: a prefix-cache hit
    refs = {k: _alone(model, p, bs) for k, p in {"a": pa, "b": pb, "c": pc, "d": pd}.items()}
    model.allocate_kv_cache(64, bs)
    a = Seq(pa, [3, 9, 5])
    b = Seq(pb, [11, 2, 20, 7, 13])
    c = Seq(pc, [30, 31, 17, 4])
    d = Seq(pd, [30, 31, 25, 26])  # blocks 30, 31 hold C's first 8 tokens
    # Earlier steps: A and B prefilled except their last token, C's first 8 tokens.
    run_step(model, [a, b, c], [9, 16, 8], bs)
    d.num_computed = 8  # prefix hit: its first 8 tokens are already in the cache (C's blocks)
    # One mixed step, decodes interleaved with prefill chunks: A, C (chunk), B, D (after hit).
    out = run_step(model, [a, c, b, d], [1, 6, 1, 5], bs)
    assert (out[0] - refs["a"][9:]).abs().max().item() < TOL
    assert (out[1] - refs["c"][8:]).abs().max().item() < TOL
    assert (out[2] - refs["b"][16:]).abs().max().item() < TOL
    assert (out[3] - refs["d"][8:]).abs().max().item() < TOL


def test_many_decodes_with_different_lengths(model):
    bs = 4
    prompts = [_prompt(n, 10 + n) for n in (1, 2, 5, 8, 13)]
    refs = [_alone(model, p, bs)[-1] for p in prompts]
    model.allocate_kv_cache(64, bs)
    seqs, nxt = [], 1
    for p in prompts:
        n = -(-len(p) // bs)
        seqs.append(Seq(p, list(range(nxt, nxt + n))))
        nxt += n
    # Everyone but the last token, then all last tokens together as one vectorized decode step
    # (the 1-token prompt is a 1-token "prefill", i.e. also a decode-shaped request).
    head = [s for s in seqs if len(s.tokens) > 1]
    run_step(model, head, [len(s.tokens) - 1 for s in head], bs)
    out = run_step(model, seqs, [1] * len(seqs), bs)
    for got, ref in zip(out, refs, strict=True):
        assert (got[0] - ref).abs().max().item() < TOL


def test_padding_tokens_are_ignored(model):
    from tests.helpers.paged import build_step

    bs = 4
    tokens = _prompt(9, 5)
    ref = _alone(model, tokens, bs)
    model.allocate_kv_cache(64, bs)
    ids, pos, meta = build_step([Seq(tokens, [1, 2, 3])], [9], bs)
    # Two trailing pad tokens written to the null block 0, as a fixed-size batch would do.
    ids = torch.cat([ids, torch.zeros(2, dtype=torch.int64)])
    pos = torch.cat([pos, torch.zeros(2, dtype=torch.int64)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.zeros(2, dtype=torch.int64)])
    logits = model.compute_logits(model(ids, pos, meta))
    assert (logits[:9] - ref).abs().max().item() < TOL


def test_kv_cache_shape_and_bytes(model):
    model.allocate_kv_cache(7, 16)
    cfg = model.cfg
    attn = model.layers[0].self_attn
    assert attn.k_cache.shape == (7, 16, cfg.num_key_value_heads, cfg.head_dim)
    per_block = model.kv_cache_bytes_per_block(16)
    assert per_block == 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * cfg.head_dim * 4


@pytest.mark.parametrize("seq_q,seq_k", [(1, 37), (5, 5), (4, 19)])
def test_sdpa_path_agrees_with_reference(seq_q, seq_k):
    g = torch.Generator().manual_seed(seq_q * 100 + seq_k)
    q = torch.randn(3, seq_q, 6, 8, generator=g)
    k, v = torch.randn(2, 3, seq_k, 2, 8, generator=g)
    q_pos = torch.arange(seq_k - seq_q, seq_k)
    allowed = (torch.arange(seq_k)[None] <= q_pos[:, None]).expand(3, seq_q, seq_k)
    ref = reference._attend(q, k, v, allowed, 0.3)
    got = reference._attend_sdpa(q, k, v, allowed, 0.3)
    assert (got - ref).abs().max().item() < 1e-5
    if seq_q == seq_k:
        assert (reference._attend_sdpa(q, k, v, None, 0.3) - ref).abs().max().item() < 1e-5
