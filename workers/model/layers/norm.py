"""RMSNorm, with the residual add fused into the norm on the kernel paths."""

from __future__ import annotations

import torch
from torch import nn

from workers import cpu_ops
from workers.model.layers.kernel_path import kernel_path


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device),
                                   requires_grad=False)
        self.select_kernels()

    def select_kernels(self) -> None:
        self.path = kernel_path(self.weight.device, self.weight.dtype)
        if self.path == "triton":
            from workers.triton_ops import norm_act

            self._triton_norm = norm_act.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "cpu" and x.dim() == 2:
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        if self.path == "triton" and x.dim() == 2 and x.stride(-1) == 1:
            return self._triton_norm(x, self.weight, self.eps)
        return self.forward_torch(x)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)); the kernel paths add in place, one pass for both."""
        if self.path == "cpu" and h.dim() == 2 and h.is_contiguous():
            return h, cpu_ops.rms_norm(h, self.weight, self.eps, residual=delta)
        if (self.path == "triton" and h.dim() == 2 and h.is_contiguous()
                and delta.stride(-1) == 1):
            return h, self._triton_norm(h, self.weight, self.eps, residual=delta)
        h = h + delta
        return h, self.forward_torch(h)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 so bf16/fp16 runs do not lose the small variances.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
