"""One tower block: x + attn(norm1(x)), then x + mlp(norm2(x)); the norms and the MLP follow
the family (norm.py, mlp.py)."""

from __future__ import annotations

import torch
from torch import nn

from workers.model.llama import WeightSource
from workers.model.vision.attention import VisionAttention
from workers.model.vision.config import VisionConfig
from workers.model.vision.mlp import GatedVisionMLP, VisionMLP
from workers.model.vision.norm import load_norm, make_norm
from workers.model.vision.parallel import VisionShard


class VisionBlock(nn.Module):
    def __init__(self, v: VisionConfig, shard: VisionShard, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.norm1 = make_norm(v, v.embed_dim, dtype, device)
        self.norm2 = make_norm(v, v.embed_dim, dtype, device)
        self.attn = VisionAttention(v, shard, dtype, device)
        self.mlp: VisionMLP | GatedVisionMLP = (
            VisionMLP(v, shard, dtype, device) if v.kind == "qwen2_vl"
            else GatedVisionMLP(v, shard, dtype, device))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))

    def load(self, src: WeightSource, prefix: str) -> None:
        load_norm(self.norm1, src, f"{prefix}.norm1")
        load_norm(self.norm2, src, f"{prefix}.norm2")
        self.attn.load(src, f"{prefix}.attn")
        self.mlp.load(src, f"{prefix}.mlp")
