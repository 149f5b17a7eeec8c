"""Patch embedding: HF's Conv3d with kernel = stride = (temporal, patch, patch) and no bias.

Kernel and stride being equal, each output is one dot product of a flattened patch with a
flattened filter, so the convolution is a single [N, C*T*P*P] x [C*T*P*P, embed] matmul over
the rows pixel_values already holds (their layout is the filter's (C, T, P, P) flattening).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.layers import linear, param, prepack
from workers.model.llama import WeightSource
from workers.model.vision.config import VisionConfig


class PatchEmbed(nn.Module):
    def __init__(self, v: VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = param((v.embed_dim, v.patch_dim), dtype, device)
        self.packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = prepack(self.weight)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C*T*P*P] (any float dtype) -> [N, embed] in the weight's dtype."""
        return linear(pixel_values.to(self.weight.dtype), self.weight, self.packed)

    def load(self, src: WeightSource, prefix: str) -> None:
        self.weight.copy_(src.read(f"{prefix}.proj.weight").reshape(self.weight.shape))
