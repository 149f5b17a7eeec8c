"""Patch merger: norm each patch, concatenate each merge_size**2 square of patches (already
adjacent rows) into one vector, and map it to the LM's width: Linear, GELU, Linear. Replicated
on every rank (it runs once per LM token, a quarter of the patches)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.layers import ColumnParallelLinear
from workers.model.llama import WeightSource
from workers.model.vision.config import VisionConfig
from workers.model.vision.norm import load_norm, make_norm


class PatchMerger(nn.Module):
    def __init__(self, v: VisionConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.width = v.embed_dim * v.merge_unit
        self.ln_q = make_norm(v, v.embed_dim, dtype, device)
        self.fc1 = ColumnParallelLinear(self.width, self.width, True, dtype, device)
        self.fc2 = ColumnParallelLinear(self.width, v.out_hidden_size, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[patches, embed] -> [patches / merge_size**2, LM hidden]."""
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).reshape(-1, self.width))))

    def load(self, src: WeightSource, prefix: str) -> None:
        load_norm(self.ln_q, src, f"{prefix}.ln_q")
        for layer, hf in ((self.fc1, "mlp.0"), (self.fc2, "mlp.2")):
            layer.weight.copy_(src.read(f"{prefix}.{hf}.weight"))
            assert layer.bias is not None
            layer.bias.copy_(src.read(f"{prefix}.{hf}.bias"))
