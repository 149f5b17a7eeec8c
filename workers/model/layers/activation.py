"""The gated MLP's activation: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers import cpu_ops
from workers.model.layers.kernel_path import kernel_path


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[N, 2 * C] = [gate | up] -> silu(gate) * up in torch ops (the reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up as one fused kernel where one applies, chosen when built."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.dtype, self.device = dtype, device
        self.select_kernels()

    def select_kernels(self) -> None:
        self.path = kernel_path(self.device, self.dtype)
        if self.path == "triton":
            from workers.triton_ops import norm_act

            self._triton = norm_act.silu_and_mul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.path == "cpu" and gate_up.dim() == 2:
            return cpu_ops.silu_and_mul(gate_up)
        if self.path == "triton" and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self._triton(gate_up)
        return silu_and_mul(gate_up)
