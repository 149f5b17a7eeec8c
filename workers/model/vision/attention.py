"""Block-diagonal self-attention of the tower: patches attend only within their segment (a
frame of an image, or one of Qwen2.5-VL's windows), never across images, with no causal mask."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.layers import ColumnParallelLinear
from workers.model.llama import WeightSource
from workers.model.vision.config import VisionConfig
from workers.model.vision.parallel import VisionShard, row_linear
from workers.model.vision.rotary import apply_rotary


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
                      scale: float) -> torch.Tensor:
    """q, k, v [N, heads, hd]; segments [bounds[i], bounds[i+1]) cover the N rows in order.

    Segments of one length are gathered into one batched SDPA call (windows are mostly equal
    squares, so a whole tower layer is a few calls, not one per window); a single segment
    attends in place without a gather."""
    n = q.shape[0]
    if len(bounds) == 2 and bounds == [0, n]:
        return _sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale)[0]
    by_len: dict[int, list[int]] = defaultdict(list)
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e > s:
            by_len[e - s].append(s)
    out = torch.empty_like(q)
    for length, starts in by_len.items():
        idx = (torch.tensor(starts, device=q.device).unsqueeze(1)
               + torch.arange(length, device=q.device))  # [segments, length]
        out[idx] = _sdpa(q[idx], k[idx], v[idx], scale)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, L, heads, hd] each -> [B, L, heads, hd], full (non-causal) attention."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       scale=scale)
    return o.transpose(1, 2)


class VisionAttention(nn.Module):
    """Fused qkv (with bias) column-parallel by heads, proj row-parallel (see parallel.py)."""

    def __init__(self, v: VisionConfig, shard: VisionShard, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.embed, self.head_dim, self.shard = v.embed_dim, v.head_dim, shard
        self.scale = v.head_dim**-0.5
        width = shard.heads * v.head_dim
        self.qkv = ColumnParallelLinear(v.embed_dim, 3 * width, True, dtype, device)
        self.proj = row_linear(shard, width, v.embed_dim, True, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bounds: list[int]) -> torch.Tensor:
        heads, hd = self.shard.heads, self.head_dim
        q, k, v = self.qkv(x).view(-1, 3, heads, hd).unbind(1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = segment_attention(q, k, v, bounds, self.scale)
        return self.proj(out.reshape(-1, heads * hd))

    def load(self, src: WeightSource, prefix: str) -> None:
        # HF's qkv rows are [q | k | v], each head-major: this rank's heads from each third
        e, hd, shard = self.embed, self.head_dim, self.shard
        s, n = shard.rank * shard.heads * hd, shard.heads * hd
        for kind in ("weight", "bias"):
            parts = [src.read(f"{prefix}.qkv.{kind}", 0, part * e + s, part * e + s + n)
                     for part in range(3)]
            getattr(self.qkv, kind).copy_(torch.cat(parts, dim=0))
        self.proj.weight.copy_(src.read(f"{prefix}.proj.weight", 1, s, s + n))
        assert self.proj.bias is not None
        self.proj.bias.copy_(src.read(f"{prefix}.proj.bias"))
