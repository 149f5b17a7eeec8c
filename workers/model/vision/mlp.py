"""The tower's MLPs: Qwen2-VL's fc1 / act / fc2 and Qwen2.5-VL's gated gate/up/down, all with
biases, rows split over ranks like the LM's MLP (padded rows read as zeros and stay zero:
act(0) = 0 for quick_gelu, gelu and silu)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.layers import ColumnParallelLinear
from workers.model.llama import WeightSource, read_padded
from workers.model.vision.config import VisionConfig
from workers.model.vision.parallel import VisionShard, row_linear


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu(x)
    if name in ("gelu", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")
    raise ValueError(f"unsupported vision activation {name!r}")


class VisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1(x)))."""

    def __init__(self, v: VisionConfig, shard: VisionShard, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.act, self.shard = v.hidden_act, shard
        self.fc1 = ColumnParallelLinear(v.embed_dim, shard.inter, True, dtype, device)
        self.fc2 = row_linear(shard, shard.inter, v.embed_dim, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activation(self.act, self.fc1(x)))

    def load(self, src: WeightSource, prefix: str) -> None:
        s, e = self.shard.rank * self.shard.inter, (self.shard.rank + 1) * self.shard.inter
        self.fc1.weight.copy_(read_padded(src, f"{prefix}.fc1.weight", 0, s, e))
        assert self.fc1.bias is not None and self.fc2.bias is not None
        self.fc1.bias.copy_(read_padded(src, f"{prefix}.fc1.bias", 0, s, e))
        self.fc2.weight.copy_(read_padded(src, f"{prefix}.fc2.weight", 1, s, e))
        self.fc2.bias.copy_(src.read(f"{prefix}.fc2.bias"))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), gate and up fused into one column-parallel."""

    def __init__(self, v: VisionConfig, shard: VisionShard, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.act, self.shard = v.hidden_act, shard
        self.gate_up_proj = ColumnParallelLinear(v.embed_dim, 2 * shard.inter, True, dtype,
                                                 device)
        self.down_proj = row_linear(shard, shard.inter, v.embed_dim, True, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(activation(self.act, gate) * up)

    def load(self, src: WeightSource, prefix: str) -> None:
        s, e = self.shard.rank * self.shard.inter, (self.shard.rank + 1) * self.shard.inter
        for kind in ("weight", "bias"):
            parts = [read_padded(src, f"{prefix}.{name}.{kind}", 0, s, e)
                     for name in ("gate_proj", "up_proj")]
            getattr(self.gate_up_proj, kind).copy_(torch.cat(parts, dim=0))
        self.down_proj.weight.copy_(read_padded(src, f"{prefix}.down_proj.weight", 1, s, e))
        assert self.down_proj.bias is not None
        self.down_proj.bias.copy_(src.read(f"{prefix}.down_proj.bias"))
