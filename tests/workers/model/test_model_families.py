"""Qwen3, Qwen3-MoE and Mixtral against transformers on tiny random checkpoints written by
save_pretrained: the registry, config keys as transformers reads them, prefill logits and greedy
tokens at TP=1 and TP=2 (real gloo ranks), and the per-rank expert slices."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.multiproc import run_tp
from tests.helpers.paged import greedy_generate
from tests.helpers.tiny_llama import hf_greedy, hf_logits, make_tiny_hf_llama
from tests.workers.model.test_model_hf_parity import PROMPTS, _ours_batched
from workers.model.config import ModelConfig
from workers.model.loader import SafetensorsSource, load_model
from workers.model.mixtral import MixtralForCausalLM
from workers.model.moe.block import SparseMoeBlock
from workers.model.qwen3 import Qwen3ForCausalLM
from workers.model.qwen3_moe import Qwen3MoeForCausalLM
from workers.model.registry import model_class

HF_BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               max_position_embeddings=256)
FAMILIES = {
    # head_dim 24 != hidden / heads = 16
    "qwen3": dict(arch="qwen3", head_dim=24),
    "qwen3_tied": dict(arch="qwen3", tie_word_embeddings=True),
    # a dense layer among the sparse ones, renormalised top-k
    "qwen3_moe": dict(arch="qwen3_moe", mlp_only_layers=[0], norm_topk_prob=True),
    "mixtral": dict(arch="mixtral"),
}


def test_registry_picks_the_class_and_names_the_supported_ones() -> None:
    assert model_class("qwen3") is Qwen3ForCausalLM
    assert model_class("qwen3_moe") is Qwen3MoeForCausalLM
    assert model_class("mixtral") is MixtralForCausalLM
    cfg = ModelConfig.from_hf_dict(HF_BASE | {"architectures": ["Qwen3ForCausalLM"]})
    assert cfg.model_type == "qwen3" and cfg.qk_norm
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM.*MixtralForCausalLM"):
        ModelConfig.from_hf_dict(HF_BASE | {"architectures": ["GPT2LMHeadModel"],
                                            "model_type": "gpt2"})


def test_qwen3_sliding_window_keys_as_transformers() -> None:
    base = HF_BASE | {"model_type": "qwen3", "sliding_window": 8, "max_window_layers": 2}
    assert ModelConfig.from_hf_dict(base).windows() == [0, 0, 0, 0]  # use_sliding_window off
    on = ModelConfig.from_hf_dict(base | {"use_sliding_window": True})
    assert on.windows() == [0, 0, 8, 8]
    types = ["sliding_attention", "full_attention"] * 2
    typed = ModelConfig.from_hf_dict(base | {"use_sliding_window": True, "layer_types": types})
    assert typed.windows() == [8, 0, 8, 0]


def test_moe_config_keys() -> None:
    qm = ModelConfig.from_hf_dict(HF_BASE | {
        "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "mlp_only_layers": [1], "decoder_sparse_step": 1})
    assert (qm.num_experts, qm.num_experts_per_tok, qm.moe_intermediate_size) == (8, 2, 32)
    assert not qm.norm_topk_prob  # transformers' default for Qwen3-MoE
    assert [qm.is_moe_layer(i) for i in range(4)] == [True, False, True, True]
    step2 = ModelConfig.from_hf_dict(HF_BASE | {
        "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32,
        "decoder_sparse_step": 2})
    assert [step2.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    mx = ModelConfig.from_hf_dict(HF_BASE | {"architectures": ["MixtralForCausalLM"],
                                             "num_local_experts": 8, "sliding_window": 16})
    assert mx.norm_topk_prob and mx.moe_intermediate_size == 128 and mx.num_experts == 8
    assert mx.windows() == [16] * 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: make_tiny_hf_llama(str(root / name), **kw) for name, kw in FAMILIES.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_logits_match_hf_tp1(checkpoints, family: str) -> None:
    path = checkpoints[family]
    for prompt, got in zip(PROMPTS, _ours_batched(path, PROMPTS), strict=True):
        assert (got - hf_logits(path, prompt)).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_greedy_matches_hf_generate_tp1(checkpoints, family: str) -> None:
    path = checkpoints[family]
    model, _ = load_model(path, 0, 1, torch.float32, torch.device("cpu"))
    model.allocate_kv_cache(32, 4)
    for prompt in PROMPTS[:2]:
        ours = greedy_generate(model, prompt, 10, 4, first_block=1)
        assert ours == hf_greedy(path, prompt, 10)
        assert len(set(ours)) > 1


def test_each_rank_loads_its_expert_slices(checkpoints) -> None:
    path = checkpoints["mixtral"]
    src = SafetensorsSource(path)
    full = src.read("model.layers.1.block_sparse_moe.experts.2.w3.weight")  # up, [I, H]
    down = src.read("model.layers.1.block_sparse_moe.experts.2.w2.weight")  # [H, I]
    half = full.shape[0] // 2
    for rank in range(2):
        model, _ = load_model(path, rank, 2, torch.float32, torch.device("cpu"))
        moe = model.layers[1].mlp
        assert isinstance(moe, SparseMoeBlock) and moe.inter == half
        assert torch.equal(moe.w13[2, half:], full[rank * half : (rank + 1) * half])
        assert torch.equal(moe.w2[2], down[:, rank * half : (rank + 1) * half])
        assert torch.equal(moe.gate, src.read("model.layers.1.block_sparse_moe.gate.weight"))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_tp2_matches_hf(tmp_path, checkpoints, family: str) -> None:
    path = checkpoints[family]
    ranks = run_tp(str(tmp_path), path, PROMPTS, world_size=2, max_new=8)
    for prompt, got0, got1 in zip(PROMPTS, ranks[0]["logits"], ranks[1]["logits"], strict=True):
        assert torch.equal(got0, got1)
        assert (got0 - hf_logits(path, prompt)).abs().max().item() < 1e-4
    assert ranks[0]["generated"] == ranks[1]["generated"]
    assert ranks[0]["generated"][0] == hf_greedy(path, PROMPTS[0], 8)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_ties_fall_as_in_transformers(family: str) -> None:
    """Experts with identical router rows tie exactly: both routers must keep the same ones."""
    import transformers

    from workers.model.moe.routing import select_experts

    if family == "mixtral":
        hf_cfg = transformers.MixtralConfig(hidden_size=16, num_local_experts=8,
                                            num_experts_per_tok=2)
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(hf_cfg)
        renorm = True
    else:
        hf_cfg = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                                             norm_topk_prob=False)
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(hf_cfg)
        renorm = False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 16, generator=gen)
    weight[5] = weight[2]  # experts 2 and 5 tie for every token
    weight[7] = weight[2]
    with torch.no_grad():
        router.weight.copy_(weight)
        x = torch.randn(64, 16, generator=gen)
        _, hf_w, hf_ids = router(x)
    ours_w, ours_ids = select_experts(torch.nn.functional.linear(x, weight), 2, renorm)
    assert torch.equal(ours_ids, hf_ids)
    assert torch.allclose(ours_w, hf_w.float())
    assert bool(((hf_ids == 2) | (hf_ids == 5)).any())  # the tie was in play
