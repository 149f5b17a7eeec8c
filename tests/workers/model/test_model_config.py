"""ModelConfig parsing, presets, rotary frequencies and the TP building blocks at world size 1."""

from __future__ import annotations

import pytest
import torch

from workers.model.config import ModelConfig, dummy_config
from workers.model.layers import VocabParallelEmbedding, pad_to_multiple, rope_inv_freq
from workers.model.llama import TPLayout
from workers.model.loader import DummySource, hf_param_shapes, load_model, load_model_config

HF_BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
               max_position_embeddings=256)


def test_from_hf_dict_transformers5_rope_parameters():
    cfg = ModelConfig.from_hf_dict(
        HF_BASE | {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}})
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling is None and cfg.head_dim == 16


def test_from_hf_dict_legacy_llama3_scaling_and_eos_list():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf_dict(
        HF_BASE | {"rope_theta": 500000.0, "rope_scaling": scaling, "eos_token_id": [7, 8]})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.eos_token_id == 7


def test_from_hf_dict_qwen2_biases_qkv_only():
    cfg = ModelConfig.from_hf_dict(HF_BASE | {"model_type": "qwen2"})
    assert cfg.attention_bias and not cfg.o_proj_bias


def test_from_hf_dict_rejects_other_architectures():
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_dict(HF_BASE | {"model_type": "gpt2"})


def test_dummy_presets():
    tiny = load_model_config("dummy:tiny")
    assert (tiny.hidden_size, tiny.intermediate_size, tiny.num_hidden_layers) == (256, 688, 4)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads, tiny.vocab_size) == (8, 4, 32000)
    assert tiny.max_position_embeddings == 2048
    with pytest.raises(ValueError, match="preset"):
        dummy_config("dummy:nope")


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, params)
    assert torch.allclose(ours.float(), ref.float(), rtol=1e-6)


def test_tp_layout_pads_kv_heads_to_tp_multiple():
    cfg = dummy_config("dummy:micro")
    cfg.num_attention_heads, cfg.num_key_value_heads = 9, 3
    lays = [TPLayout(cfg, r, 2) for r in range(2)]
    assert [(lay.q_start, lay.q_heads, lay.kv_start, lay.kv_heads) for lay in lays] == [
        (0, 6, 0, 2), (6, 6, 2, 2)]
    assert lays[0].padded_heads and not TPLayout(cfg, 0, 3).padded_heads


def test_vocab_parallel_embedding_masks_other_shards():
    emb = VocabParallelEmbedding(10, 3, tp_rank=1, tp_size=2, dtype=torch.float32,
                                 device=torch.device("cpu"))
    emb.weight.data = torch.arange(15, dtype=torch.float32).view(5, 3) + 1
    out = emb(torch.tensor([0, 4, 5, 9]))  # ids 0..4 belong to rank 0: zero rows here
    assert out[:2].abs().sum() == 0
    assert torch.equal(out[2], emb.weight[0]) and torch.equal(out[3], emb.weight[4])
    assert pad_to_multiple(49152, 3) == 49152 and pad_to_multiple(255, 2) == 256


def test_dummy_weights_independent_of_tp_and_seeded():
    cfg = dummy_config("dummy:micro")
    a, b = DummySource(cfg, 0), DummySource(cfg, 0)
    name = "model.layers.1.self_attn.q_proj.weight"
    full = a.read(name)
    assert full.shape == hf_param_shapes(cfg)[name]
    assert torch.equal(b.read(name, 0, 16, 32), full[16:32])
    assert not torch.equal(DummySource(cfg, 1).read(name), full)
    assert 0.15 < full.std().item() < 0.25


def test_dummy_model_context_dependent_greedy():
    model, _ = load_model("dummy:micro", 0, 1, torch.float32, torch.device("cpu"))
    from tests.helpers.paged import greedy_generate

    model.allocate_kv_cache(16, 4)
    out = greedy_generate(model, [5, 6, 7], 8, 4, first_block=1)
    assert len(set(out)) > 1


def test_forward_without_kv_cache_raises():
    model, _ = load_model("dummy:micro", 0, 1, torch.float32, torch.device("cpu"))
    from tests.helpers.paged import Seq, build_step

    ids, pos, meta = build_step([Seq([1, 2], [1])], [2], 4)
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model(ids, pos, meta)
