"""Qwen3 (dense): the Llama layout plus a per-head RMSNorm on q and k before rotary.

head_dim is its own config key (Qwen3-0.6B: 16 heads x 128 = 2048 > hidden 1024), which the
Llama code already honours; q/k/v carry no bias unless attention_bias says so (then o_proj too,
as in transformers).
"""

from __future__ import annotations

import torch

from workers.attention.base import AttentionStep
from workers.model.config import ModelConfig
from workers.model.layers import RMSNorm, RotaryEmbedding
from workers.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    TPLayout,
    WeightSource,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, lay: TPLayout, rope: RotaryEmbedding, tp_rank: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(cfg, lay, rope, tp_rank, dtype, device)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                attn: AttentionStep) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not allocated: call allocate_kv_cache() first")
        hd, lay = self.head_dim, self.lay
        qkv = self.qkv_proj(x)
        q_cols, k_cols = lay.q_heads * hd, lay.kv_heads * hd
        # The norms run over each head's head_dim (rows of [T * heads, head_dim]); the backend
        # then rotates the normed q and k in place, as transformers norms before rotary. Zero
        # padded heads stay zero (0 * rsqrt(eps)).
        q = self.q_norm(qkv[:, :q_cols].reshape(-1, hd))
        k = self.k_norm(qkv[:, q_cols : q_cols + k_cols].reshape(-1, hd))
        qkv = torch.cat([q.view(-1, q_cols), k.view(-1, k_cols), qkv[:, q_cols + k_cols :]],
                        dim=1)
        out = attn(qkv, positions, self.rope, lay.q_heads, lay.kv_heads, hd, self.k_cache,
                   self.v_cache, self.scale)
        return self.o_proj(out.view(-1, lay.q_heads * hd))

    def load(self, src: WeightSource, prefix: str) -> None:
        super().load(src, prefix)
        self.q_norm.weight.copy_(src.read(f"{prefix}.q_norm.weight"))
        self.k_norm.weight.copy_(src.read(f"{prefix}.k_norm.weight"))


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(self) -> Qwen3Attention:
        return Qwen3Attention(self.cfg, self.layout, self.rope, self.tp_rank, self.dtype,
                              self.device)

    def make_layer(self, i: int) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(self.cfg, self.layout, self.rope, self.tp_rank, self.dtype,
                                 self.device, self_attn=self.make_attention())
