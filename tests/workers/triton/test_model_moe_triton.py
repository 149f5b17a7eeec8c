"""A tiny Qwen3-MoE on the Triton path (attention and the fused MoE kernels) against the same
weights on the torch path and against transformers: a batched prefill, then decodes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.paged import Seq, greedy_generate, run_step
from tests.helpers.tiny_llama import hf_logits, make_tiny_hf_llama
from tests.workers.model.test_model_hf_parity import BS, PROMPTS
from tests.workers.triton.common import DEVICE
from workers import cpu_ops
from workers.model.loader import load_model
from workers.model.moe.block import SparseMoeBlock


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_hf_llama(str(tmp_path_factory.mktemp("qwen3moe")), arch="qwen3_moe",
                              mlp_only_layers=[0], norm_topk_prob=True)


def _model(path: str, backend: str):
    model, _ = load_model(path, 0, 1, torch.float32, DEVICE)
    model.set_attention_backend(backend)
    return model


def test_triton_backend_brings_the_fused_moe(checkpoint, monkeypatch) -> None:
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    tri, ref = _model(checkpoint, "triton"), _model(checkpoint, "torch")
    paths = {m.path for m in tri.modules() if isinstance(m, SparseMoeBlock)}
    assert paths == {"triton"}
    assert {m.path for m in ref.modules() if isinstance(m, SparseMoeBlock)} == {"torch"}

    for model in (tri, ref):
        model.allocate_kv_cache(64, BS)
    outs = []
    for model in (tri, ref):
        seqs, nxt = [], 1
        for p in PROMPTS:
            n = -(-len(p) // BS)
            seqs.append(Seq(list(p), list(range(nxt, nxt + n))))
            nxt += n
        outs.append(run_step(model, seqs, [len(p) for p in PROMPTS], BS))
    for prompt, got, want in zip(PROMPTS, *outs, strict=True):
        assert (got - want).abs().max().item() < 1e-4
        assert (got - hf_logits(checkpoint, prompt)).abs().max().item() < 1e-4
    assert greedy_generate(tri, PROMPTS[1], 6, BS, first_block=40) == \
        greedy_generate(ref, PROMPTS[1], 6, BS, first_block=40)
