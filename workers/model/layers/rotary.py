"""Rotary position embeddings (with Llama-3 and linear/dynamic scaling of the frequencies)."""

from __future__ import annotations

import math

import torch
from torch import nn

from workers import cpu_ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float64) for rotary embeddings, with linear or llama3 scaling."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX / HF Llama) layout; cos/sin precomputed once for every position."""

    # [max_positions, head_dim / 2] float32 tables, registered as (non-persistent) buffers so
    # they follow the module's device; declared here because a buffer read through
    # nn.Module.__getattr__ would type as `Tensor | Module`
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 device: torch.device):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        self.register_buffer("cos", angles.cos().float().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().float().to(device), persistent=False)

    def rotate_and_cache_(self, positions: torch.Tensor, qkv: torch.Tensor, q_heads: int,
                          kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
        """Fused [q | k | v] rows qkv [T, ...]: rotate q and k in place and write K/V into the
        cache slots, in one CPU kernel pass; False (nothing done) when the kernel does not
        apply, and the caller rotates and writes the cache itself."""
        if not (cpu_ops.active(qkv) and qkv.stride(-1) == 1 and positions.dtype == torch.int64
                and slots.dtype == torch.int64 and k_cache.dtype == qkv.dtype
                and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        cpu_ops.rotary_kv_(qkv, q_heads, kv_heads, head_dim, positions.contiguous(), self.cos,
                           self.sin, k_cache, v_cache, slots.contiguous())
        return True

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.forward_torch(positions, x)

    def forward_torch(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated, same dtype."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, hd/2]
        sin = self.sin[positions].unsqueeze(1)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
