"""Real-shape random-weight presets against the published configs, slice-wise random weights,
and --load-format dummy on a config-only Hugging Face directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from workers.model.config import dummy_config
from workers.model.loader import ShardDummySource, hf_param_shapes, load_model

# Published config.json values (meta-llama/Llama-3.2-1B, meta-llama/Meta-Llama-3-8B,
# Qwen/Qwen2-0.5B, HuggingFaceTB/SmolLM2-135M) and their parameter counts, written out by hand.
PUBLISHED = {
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                     vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=131072, attention_bias=False),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                     vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=8192, attention_bias=False),
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, head_dim=64, intermediate_size=4864,
                       vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=131072, attention_bias=True),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                         vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192, attention_bias=False),
}
PARAMS = {"llama-1b": 1_235_814_400, "llama-8b": 8_030_261_248, "qwen2-0.5b": 494_032_768,
          "smollm2-135m": 134_515_008}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_preset_matches_published_config(preset: str) -> None:
    cfg = dummy_config(f"dummy:{preset}")
    for key, value in PUBLISHED[preset].items():
        assert getattr(cfg, key) == value, key
    assert cfg.o_proj_bias is False
    total = sum(math.prod(s) for s in hf_param_shapes(cfg).values())
    assert total == PARAMS[preset]


def test_llama_1b_has_llama3_rope_scaling() -> None:
    assert dummy_config("dummy:llama-1b").rope_scaling == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert dummy_config("dummy:llama-8b").rope_scaling is None


def test_shard_source_draws_only_the_slice() -> None:
    cfg = dummy_config("dummy:llama-1b")
    src = ShardDummySource(cfg, seed=0, device=torch.device("cpu"), dtype=torch.bfloat16)
    name = "model.layers.3.mlp.down_proj.weight"  # [2048, 8192], a row-parallel split on dim 1
    part = src.read(name, 1, 4096, 8192)
    assert part.shape == (2048, 4096) and part.dtype == torch.bfloat16
    assert abs(part.float().std().item() - 0.02) < 1e-3
    assert torch.equal(part, src.read(name, 1, 4096, 8192))  # seeded by (name, slice)
    assert not torch.equal(part, src.read(name, 1, 0, 4096))
    assert torch.equal(src.read("model.norm.weight"), torch.ones(2048, dtype=torch.bfloat16))


def _tiny_qwen2_dir(tmp_path: Path) -> Path:
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_config_only_dir_loads_with_dummy_format(tmp_path: Path) -> None:
    path = str(_tiny_qwen2_dir(tmp_path))
    with pytest.raises(ValueError, match="safetensors"):
        load_model(path, 0, 1, torch.float32, torch.device("cpu"))
    model, cfg = load_model(path, 1, 2, torch.float32, torch.device("cpu"), load_format="dummy")
    assert cfg.attention_bias and cfg.tie_word_embeddings
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.shape == ((2 + 2 * 1) * 16, 64)  # rank 1 of 2: 2 q heads, 1 kv head
    assert qkv.bias is not None and bool(qkv.bias.abs().sum() > 0)
    assert model.embed_tokens.weight.shape == (256, 64)


@pytest.mark.slow
def test_config_only_dir_generates(tmp_path: Path) -> None:
    from launch import LLM, SamplingParams
    from tests.helpers.procs import wait_no_descendants

    path = str(_tiny_qwen2_dir(tmp_path))
    try:
        with LLM(model=path, load_format="dummy", device="cpu") as llm:
            assert llm.tokenizer is None  # config.json only: token-id prompts
            outs = llm.generate([[5, 6, 7], [9, 10]], SamplingParams(max_tokens=6, ignore_eos=True,
                                                                   temperature=0.0))
        assert [len(o.token_ids) for o in outs] == [6, 6]
        assert all(o.finish_reason == "length" for o in outs)
        assert all(0 <= t < 512 for o in outs for t in o.token_ids)
    finally:
        assert wait_no_descendants(10) == []


def test_checkpoint_dtype_is_read_for_dtype_auto(tmp_path: Path) -> None:
    from workers.model.loader import load_model_config

    assert dummy_config("dummy:llama-8b").torch_dtype == "bfloat16"
    assert dummy_config("dummy:tiny").torch_dtype == "float32"
    path = _tiny_qwen2_dir(tmp_path)
    assert load_model_config(str(path)).torch_dtype is None
    for key in ("torch_dtype", "dtype"):  # transformers < 5 and >= 5
        config = json.loads((path / "config.json").read_text())
        config.pop("torch_dtype", None)
        (path / "config.json").write_text(json.dumps(config | {key: "float16"}))
        assert load_model_config(str(path)).torch_dtype == "float16"
