"""Tensor parallelism: seeded dummy weights give the same function at every tp_size; head padding
is announced in one log line."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers.multiproc import run_tp
from tests.helpers.paged import Seq, greedy_generate, run_step
from workers.model.config import dummy_config
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import load_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300, 400, 500, 3, 4, 5, 6, 7, 8, 9, 10]]


def test_padding_is_logged_once_on_rank0(caplog):
    cfg = dummy_config("dummy:micro")
    cfg.num_attention_heads, cfg.num_key_value_heads = 6, 3
    with caplog.at_level(logging.INFO, logger="workers.model.llama"):
        LlamaForCausalLM(cfg, 0, 2, torch.float32, torch.device("cpu"))
        LlamaForCausalLM(cfg, 1, 2, torch.float32, torch.device("cpu"))
        LlamaForCausalLM(cfg, 0, 1, torch.float32, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "padding" in r.getMessage()]
    assert len(lines) == 1 and "4 KV / 8 query heads" in lines[0]


def test_shard_shapes_at_tp2():
    cfg = dummy_config("dummy:micro")  # 4 q / 2 kv heads, head_dim 16, inter 128, vocab 512
    model = LlamaForCausalLM(cfg, 1, 2, torch.float32, torch.device("cpu"))
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.weight.shape == ((2 + 2 * 1) * 16, 64)
    assert attn.o_proj.weight.shape == (64, 2 * 16)
    assert model.layers[0].mlp.gate_up_proj.weight.shape == (128, 64)
    assert model.embed_tokens.weight.shape == (256, 64) and model.embed_tokens.start == 256
    assert model.kv_cache_bytes_per_block(16) == 2 * 2 * 16 * 1 * 16 * 4


@pytest.mark.slow
def test_dummy_tp2_equals_tp1(tmp_path):
    model, _ = load_model("dummy:micro", 0, 1, torch.float32, torch.device("cpu"))
    model.allocate_kv_cache(32, 4)
    seqs = [Seq(PROMPTS[0], [1, 2]), Seq(PROMPTS[1], [3, 4, 5, 6])]
    ref_logits = run_step(model, seqs, [len(p) for p in PROMPTS], 4)
    ref_tokens = [greedy_generate(model, p, 6, 4, first_block=10) for p in PROMPTS]
    ranks = run_tp(str(tmp_path), "dummy:micro", PROMPTS, world_size=2, max_new=6)
    for r in ranks:
        for got, ref in zip(r["logits"], ref_logits, strict=True):
            assert (got - ref).abs().max().item() < 1e-4
        assert r["generated"] == ref_tokens
        # Shard-wise argmax (only (max, id) pairs cross ranks) equals argmax of full logits.
        assert r["greedy"] == torch.cat(r["logits"]).argmax(-1).tolist()


def test_greedy_tokens_equal_logits_argmax_tp1():
    cfg = dummy_config("dummy:micro")
    cfg.vocab_size = 509  # not a multiple of anything: exercises the shard padding mask
    model = LlamaForCausalLM(cfg, 0, 1, torch.float32, torch.device("cpu"))
    from workers.model.loader import DummySource

    model.load_weights(DummySource(cfg, 0))
    hidden = torch.randn(7, cfg.hidden_size)
    assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).argmax(-1))
