"""Model loading: dummy presets (seeded random weights), HF directories (safetensors) and GGUF.

Every source hands out full-model tensors by HF name and supports slicing, so a rank reads (or
generates) only what its shard needs. The small presets (dummy:tiny, dummy:micro) draw each full
tensor from one seed, so all tp_sizes see the same weights (the TP tests compare them); the
real-shape presets and `load_format="dummy"` draw only the slice a rank asks for, on its device,
so billions of parameters take a fraction of a second, and their values depend on the TP layout.
"""

from __future__ import annotations

import glob
import json
import os
import zlib

import torch
from safetensors import safe_open

from workers.model.config import (
    DUMMY_INIT_STD,
    REAL_SHAPE_INIT_STD,
    REAL_SHAPE_PRESETS,
    ModelConfig,
    dummy_config,
    dummy_preset_name,
)
from workers.model.llama import LlamaForCausalLM, WeightSource
from workers.model.moe.block import MIXTRAL_EXPERT_NAMES, QWEN3_MOE_EXPERT_NAMES, moe_param_shapes
from workers.model.paths import DUMMY_PREFIX, resolve_model
from workers.model.registry import model_class
from workers.model.vision.config import vision_param_shapes
from workers.model.vision.parallel import VisionShard

__all__ = ["resolve_model", "load_model", "load_model_config", "DummySource",
           "ShardDummySource", "SafetensorsSource", "hf_param_shapes"]


def _slice(t, shape: tuple[int, ...], dim: int | None, start: int, end: int | None):
    if dim is None:
        return t[...]
    index = [slice(None)] * len(shape)
    index[dim] = slice(start, shape[dim] if end is None else end)
    return t[tuple(index)]


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and full shapes of a checkpoint with this config (Llama layout, plus Qwen3's
    q/k norms and the experts of the MoE families)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,),
                   f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q)}
        if cfg.qk_norm:
            shapes |= {f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)}
        if cfg.model_type == "mixtral":
            shapes |= moe_param_shapes(cfg, f"{p}.block_sparse_moe", MIXTRAL_EXPERT_NAMES)
        elif cfg.is_moe_layer(i):
            shapes |= moe_param_shapes(cfg, f"{p}.mlp", QWEN3_MOE_EXPERT_NAMES)
        else:
            shapes |= {f"{p}.mlp.gate_proj.weight": (inter, h),
                       f"{p}.mlp.up_proj.weight": (inter, h),
                       f"{p}.mlp.down_proj.weight": (h, inter)}
        if cfg.attention_bias:
            shapes |= {f"{p}.self_attn.q_proj.bias": (q,), f"{p}.self_attn.k_proj.bias": (kv,),
                       f"{p}.self_attn.v_proj.bias": (kv,)}
        if cfg.o_proj_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (h,)
    if cfg.vision is not None:
        shapes |= vision_param_shapes(cfg.vision)
    return shapes


def _is_norm_weight(name: str) -> bool:
    """Norm scales are drawn as ones (the LM's, and the vision tower's norm1/norm2/ln_q)."""
    return name.endswith(("norm.weight", ".norm1.weight", ".norm2.weight", ".ln_q.weight"))


class DummySource:
    """Seeded random weights. Each tensor has its own generator (seed, name), so the values do not
    depend on tp_size, rank or load order; the full tensor is drawn on CPU, then sliced."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, std: float = DUMMY_INIT_STD):
        self.shapes = hf_param_shapes(cfg)
        self.seed, self.std = seed, std

    def has(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, dim: int | None = None, start: int = 0,
             end: int | None = None) -> torch.Tensor:
        shape = self.shapes[name]
        if _is_norm_weight(name):
            full = torch.ones(shape)
        else:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(shape, generator=gen) * self.std
        return _slice(full, shape, dim, start, end)


class ShardDummySource:
    """Random weights drawn slice by slice: read() draws only the requested slice, directly on
    `device` in `dtype` (no full tensor, no CPU detour), seeded by (seed, name, slice)."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype,
                 std: float = REAL_SHAPE_INIT_STD):
        self.shapes = hf_param_shapes(cfg)
        self.seed, self.device, self.dtype, self.std = seed, device, dtype, std

    def has(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, dim: int | None = None, start: int = 0,
             end: int | None = None) -> torch.Tensor:
        full = self.shapes[name]
        shape = list(full)
        if dim is not None:
            shape[dim] = (full[dim] if end is None else end) - start
        if _is_norm_weight(name):
            return torch.ones(shape, dtype=self.dtype, device=self.device)
        key = f"{name}:{dim}:{start}:{end}".encode()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + zlib.crc32(key))
        out = torch.randn(shape, generator=gen, dtype=self.dtype, device=self.device)
        return out.mul_(self.std)


def _tp_pads(cfg: ModelConfig, tp_size: int) -> bool:
    """Whether this TP size pads heads, MLP rows or vocabulary rows with zeros."""
    if cfg.vision is not None and VisionShard.of(cfg.vision, 0, tp_size).sharded \
            and cfg.vision.intermediate_size % tp_size:
        return True
    return any(n % tp_size for n in (cfg.num_key_value_heads, cfg.intermediate_size,
                                     cfg.vocab_size, cfg.moe_intermediate_size))


def _shard_source(cfg: ModelConfig, seed: int, tp_size: int, dtype: torch.dtype,
                  device: torch.device) -> ShardDummySource:
    # llama.read_padded appends CPU zeros where TP pads; draw on CPU then (a rare layout).
    draw_on = torch.device("cpu") if _tp_pads(cfg, tp_size) else device
    return ShardDummySource(cfg, seed, draw_on, dtype)


class SafetensorsSource:
    """All *.safetensors of a HF directory; slices are read lazily, never the whole file."""

    def __init__(self, path: str):
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        self._handles = [safe_open(f, framework="pt", device="cpu") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return tuple(self._where[name].get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, start: int = 0,
             end: int | None = None) -> torch.Tensor:
        part = self._where[name].get_slice(name)
        return _slice(part, tuple(part.get_shape()), dim, start, end)


def _read_hf_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        return ModelConfig.from_hf_dict(json.load(f))


def load_model_config(name: str) -> ModelConfig:
    """The model's config without touching its weights."""
    path = resolve_model(name)
    if path.startswith(DUMMY_PREFIX):
        return dummy_config(path)
    if path.endswith(".gguf"):
        from workers.model.gguf import gguf_model_config

        return gguf_model_config(path)
    return _read_hf_config(path)


def load_model(name: str, tp_rank: int, tp_size: int, dtype: torch.dtype, device: torch.device,
               seed: int = 0, load_format: str = "auto") -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build this rank's shard of the model and fill it from its source.

    load_format "dummy": random weights of the model's shape; a HF directory needs only its
    config.json, a .gguf only its header.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; expected auto or dummy")
    path = resolve_model(name)
    src: WeightSource
    if path.startswith(DUMMY_PREFIX):
        cfg = dummy_config(path)
        if dummy_preset_name(path) in REAL_SHAPE_PRESETS:
            src = _shard_source(cfg, seed, tp_size, dtype, device)
        else:
            src = DummySource(cfg, seed)
    elif load_format == "dummy":
        cfg = load_model_config(path)
        src = _shard_source(cfg, seed, tp_size, dtype, device)
    elif path.endswith(".gguf"):
        from workers.model.gguf import GGUFSource

        src = GGUFSource(path)
        cfg = src.config
    else:
        cfg = _read_hf_config(path)
        src = SafetensorsSource(path)
    model = model_class(cfg.model_type)(cfg, tp_rank, tp_size, dtype, device)
    model.load_weights(src)
    model.prepack_weights()
    model.eval()
    return model, cfg
