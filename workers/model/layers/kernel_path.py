"""Which implementation a layer's fused elementwise ops take, decided once per layer."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from workers import cpu_ops, triton_ops

KernelPath = Literal["cpu", "triton", "torch"]


def kernel_path(device: torch.device, dtype: torch.dtype) -> KernelPath:
    """The implementation a layer's fused elementwise ops take on this device and dtype,
    chosen when the layer is built: the C++ kernels on CPU, Triton on CUDA, else torch ops."""
    if device.type == "cpu" and cpu_ops.active(torch.empty(0, dtype=dtype)):
        return "cpu"
    if device.type == "cuda" and triton_ops.available():
        return "triton"
    return "torch"


def reselect_kernels(model: nn.Module) -> None:
    """Choose every layer's kernel path again (after cpu_ops.ENABLED changed: tests compare
    the kernels against the torch ops on one model)."""
    for m in model.modules():
        select = getattr(m, "select_kernels", None)
        if select is not None:
            select()
