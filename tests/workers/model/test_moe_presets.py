"""Real-shape Qwen3 / MoE presets against the published configs and parameter counts, the MoE-aware
roofline on them, and a small MoE preset loading slice by slice per rank."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from workers.model.config import dummy_config
from workers.model.loader import hf_param_shapes, load_model
from workers.model.moe.block import SparseMoeBlock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))

from roofline import ModelShape  # noqa: E402

# Published totals (model cards: Qwen3-0.6B 0.6B, Qwen3-8B 8.2B, Qwen3-30B-A3B 30.5B with 3.3B
# activated, Mixtral-8x7B 46.7B with 12.9B active), in billions to the digit published (the
# cards round or truncate: 3.35B is published as 3.3B).
PUBLISHED_B = {"qwen3-0.6b": (0.6, None), "qwen3-8b": (8.2, None),
               "qwen3-30b-a3b": (30.5, 3.3), "mixtral-8x7b": (46.7, 12.9)}
SHAPES = {  # (hidden, layers, heads, kv heads, head_dim, experts, top-k, expert width)
    "qwen3-0.6b": (1024, 28, 16, 8, 128, 0, 0, 0),
    "qwen3-8b": (4096, 36, 32, 8, 128, 0, 0, 0),
    "qwen3-30b-a3b": (2048, 48, 32, 4, 128, 128, 8, 768),
    "mixtral-8x7b": (4096, 32, 32, 8, 128, 8, 2, 14336),
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_B))
def test_preset_shapes_and_parameter_counts(preset: str) -> None:
    cfg = dummy_config(f"dummy:{preset}")
    got = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
           cfg.num_key_value_heads, cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok,
           cfg.moe_intermediate_size)
    assert got == SHAPES[preset]
    total, active = PUBLISHED_B[preset]
    params = sum(math.prod(s) for s in hf_param_shapes(cfg).values())
    assert params / 1e9 == pytest.approx(total, abs=0.06)  # published to one decimal
    if active is not None:
        shape = ModelShape.from_config(cfg)
        # a token's weights: its experts' and every dense weight, plus both vocab tables
        per_token = shape.linear_params + 2 * shape.lm_head_params + shape.norm_params
        per_token += cfg.num_hidden_layers * 2 * cfg.head_dim * cfg.qk_norm
        assert per_token / 1e9 == pytest.approx(active, abs=0.06)


def test_moe_roofline_reads_only_routed_experts() -> None:
    shape = ModelShape.from_config(dummy_config("dummy:qwen3-30b-a3b"))
    one = shape.weight_bytes_per_step(2, 1)
    every = shape.weight_bytes_per_step(2)
    # one token reads 8 of 128 experts per layer; a 256-token step reads nearly all
    assert shape.experts_read(1) == pytest.approx(8.0)
    assert shape.experts_read(256) == pytest.approx(128.0, rel=1e-6)
    assert one < 0.2 * every
    assert shape.weight_bytes_per_step(2, 256) == pytest.approx(every, rel=1e-6)
    dense = ModelShape.from_config(dummy_config("dummy:qwen3-8b"))
    assert dense.weight_bytes_per_step(2, 1) == dense.weight_bytes_per_step(2)


def test_small_moe_preset_loads_per_rank() -> None:
    ranks = [load_model("dummy:qwen3-moe-tiny", r, 2, torch.float32, torch.device("cpu"))[0]
             for r in range(2)]
    whole, _ = load_model("dummy:qwen3-moe-tiny", 0, 1, torch.float32, torch.device("cpu"))
    moes = [m.layers[0].mlp for m in (*ranks, whole)]
    assert all(isinstance(m, SparseMoeBlock) for m in moes)
    # rank r holds columns [r * 64, (r+1) * 64) of every expert's 128-wide intermediate
    assert torch.equal(torch.cat([moes[0].w2, moes[1].w2], dim=2), moes[2].w2)
    assert torch.equal(moes[0].w13[:, :64], moes[2].w13[:, :64])
    assert torch.equal(moes[1].w13[:, 64:], moes[2].w13[:, 192:])
