"""The whole model on the Triton backend against the same weights on the torch reference:
chunked prefill, a mixed step with a prefix-cache hit, decodes, and a decode step padded the
way the CUDA-graph runner pads it (through the staging buffers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.paged import Seq, build_step, run_step
from tests.workers.triton.common import DEVICE
from workers import cpu_ops
from workers.model.layers import reselect_kernels
from workers.model.loader import load_model
from workers.runner.input_batch import BatchInputs
from workers.runner.input_staging import InputStaging

# bf16: the kernel rounds softmax weights to bf16 for the PV product (as GPU attention kernels
# do) where the reference attends in float32; on this deliberately sensitive random model (std
# 0.2 weights) that moves logits of magnitude ~4 by up to ~0.15 after two layers.
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.3}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def models(request):
    ref, _ = load_model("dummy:micro", 0, 1, request.param, DEVICE)
    ref.set_attention_backend("torch")
    tri, _ = load_model("dummy:micro", 0, 1, request.param, DEVICE)
    tri.set_attention_backend("triton")
    return ref, tri, request.param


@pytest.fixture(autouse=True)
def torch_elementwise(monkeypatch, models):
    """Norms, rotary and the MLP on torch ops in both models, so only attention differs."""
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    for m in models[:2]:
        reselect_kernels(m)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _steps(model, block_size: int, plan):
    """Run the same sequence of steps; returns each step's logits."""
    model.allocate_kv_cache(64, block_size)
    seqs = {k: Seq(list(tokens), list(blocks)) for k, (tokens, blocks) in plan["seqs"].items()}
    outs = []
    for step in plan["steps"]:
        for name, computed in step.get("hits", {}).items():
            seqs[name].num_computed = computed
        names, counts = zip(*step["run"], strict=True)
        outs += run_step(model, [seqs[n] for n in names], list(counts), block_size)
    return outs


def test_chunked_prefill_mixed_step_and_decodes(models):
    ref, tri, dtype = models
    pa, pb, pc = _prompt(10, 1), _prompt(17, 2), _prompt(14, 3)
    pd = pc[:8] + _prompt(5, 4)  # shares C's first two blocks: a prefix-cache hit
    plan = {
        "seqs": {"a": (pa, [3, 9, 5]), "b": (pb, [11, 2, 20, 7, 13]),
                 "c": (pc, [30, 31, 17, 4]), "d": (pd, [30, 31, 25, 26])},
        "steps": [
            {"run": [("a", 9), ("b", 16), ("c", 8)]},
            {"hits": {"d": 8}, "run": [("a", 1), ("c", 6), ("b", 1), ("d", 5)]},
        ],
    }
    for got, want in zip(_steps(tri, 4, plan), _steps(ref, 4, plan), strict=True):
        assert (got.float() - want.float()).abs().max().item() < TOL[dtype]


def test_greedy_decode_loop_matches(models):
    ref, tri, dtype = models
    from tests.helpers.paged import greedy_generate

    prompt = _prompt(21, 7)
    ref.allocate_kv_cache(8, 16)
    tri.allocate_kv_cache(8, 16)
    want = greedy_generate(ref, prompt, 8, 16, first_block=3)
    got = greedy_generate(tri, prompt, 8, 16, first_block=3)
    assert got == want


def test_padded_decode_step_through_staging(models):
    """3 decodes staged into buffers padded to 8 requests / 8 tokens, as a captured graph
    sees them: the real rows equal the unpadded step and the padding writes no K/V."""
    _, tri, dtype = models
    bs = 4
    prompts = [_prompt(n, 20 + n) for n in (6, 9, 13)]
    tri.allocate_kv_cache(64, bs)
    seqs, nxt = [], 1
    for p in prompts:
        n = -(-len(p) // bs)
        seqs.append(Seq(p, list(range(nxt, nxt + n))))
        nxt += n
    run_step(tri, seqs, [len(p) - 1 for p in prompts], bs)
    ids, pos, meta = build_step(seqs, [1, 1, 1], bs, DEVICE)
    caches = [(layer.self_attn.k_cache.clone(), layer.self_attn.v_cache.clone())
              for layer in tri.layers]
    want = tri(ids, pos, meta)
    # The same step again, from the same cache contents, through padded staging buffers.
    for layer, (k, v) in zip(tri.layers, caches, strict=True):
        layer.self_attn.k_cache.copy_(k)
        layer.self_attn.v_cache.copy_(v)
    inputs = BatchInputs(
        rows=np.arange(3), num_scheduled=np.ones(3, dtype=np.int32),
        input_ids=ids.cpu().numpy(), positions=pos.cpu().numpy(),
        slot_mapping=meta.slot_mapping.cpu().numpy(),
        query_start_loc=meta.query_start_loc_np, seq_lens=meta.seq_lens_np,
        block_table=meta.block_table.cpu().numpy(), logits_indices=np.arange(3),
        sample_rows=np.arange(3), max_query_len=1, max_seq_len=meta.max_seq_len)
    staging = InputStaging(DEVICE, max_tokens=16, max_reqs=8, max_blocks_per_req=8)
    staging.seq_lens.host_np[:] = 99  # stale values from an earlier step must not leak in
    p_ids, p_pos, p_meta = staging.stage(inputs, num_tokens=8, num_reqs=8)
    assert p_meta.slot_mapping[3:].tolist() == [-1] * 5
    assert p_meta.seq_lens[3:].tolist() == [0] * 5
    assert p_meta.query_start_loc.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    got = tri(p_ids, p_pos, p_meta)
    assert torch.equal(got[:3], want)
    for layer in tri.layers:  # the padding wrote nothing: the cache equals the unpadded run's
        k_cache = layer.self_attn.k_cache
        assert k_cache[0].abs().sum().item() == 0  # the null block stays zero
