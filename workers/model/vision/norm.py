"""The tower's norms: LayerNorm with bias (Qwen2-VL) or RMSNorm (Qwen2.5-VL), eps 1e-6."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.layers import RMSNorm
from workers.model.llama import WeightSource
from workers.model.vision.config import VisionConfig

EPS = 1e-6


class LayerNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device),
                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, EPS)


def make_norm(v: VisionConfig, dim: int, dtype: torch.dtype,
              device: torch.device) -> LayerNorm | RMSNorm:
    if v.kind == "qwen2_vl":
        return LayerNorm(dim, dtype, device)
    return RMSNorm(dim, EPS, dtype, device)


def load_norm(norm: LayerNorm | RMSNorm, src: WeightSource, prefix: str) -> None:
    norm.weight.copy_(src.read(f"{prefix}.weight"))
    if isinstance(norm, LayerNorm):
        norm.bias.copy_(src.read(f"{prefix}.bias"))
