"""Attention: the backend interface (base.py), the portable reference (reference.py) and the
backends (backends/). A worker chooses its backend once, at start-up, through
select_attention_backend; only the chosen backend's module is imported, so the interface
depends on none of them."""

from __future__ import annotations

import importlib
import logging

import torch

from workers import cpu_ops, triton_ops
from workers.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

# name -> (module, class); imported on selection
_REGISTRY: dict[str, tuple[str, str]] = {
    "torch": ("workers.attention.backends.torch", "TorchAttentionBackend"),
    "cpu": ("workers.attention.backends.cpu", "CpuAttentionBackend"),
    "triton": ("workers.attention.backends.triton", "TritonAttentionBackend"),
}
BACKENDS = tuple(_REGISTRY)


def _load(name: str) -> type[AttentionBackend]:
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)


def select_attention_backend(name: str, device: torch.device, head_dim: int) -> AttentionBackend:
    """The backend for `name` (auto | torch | cpu | triton) on this device, or a clear error
    when the requested one cannot run here."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; expected auto, "
                         + ", ".join(BACKENDS))
    if name == "auto":
        if device.type == "cuda":
            if triton_ops.available():
                name = "triton"
            else:
                logger.warning("triton is not installed: CUDA attention falls back to the slow "
                               "torch reference path")
                name = "torch"
        else:
            name = "cpu" if cpu_ops.ops() is not None else "torch"
    if name == "torch":
        return _load("torch")()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU workers, not {device.type}")
        if cpu_ops.ops() is None:
            raise ValueError("attention backend 'cpu' needs the C++ kernels, which are off or "
                             "could not be built (TANDEM_CPU_KERNELS=0 or no compiler)")
        return _load("cpu")(head_dim)  # type: ignore[call-arg]
    if not triton_ops.available():
        raise ValueError("attention backend 'triton' needs the triton package "
                         "(it ships with CUDA builds of torch)")
    if device.type != "cuda" and not triton_ops.interpreting():
        raise ValueError("attention backend 'triton' runs on CUDA devices (or on CPU tensors "
                         "with TRITON_INTERPRET=1, for tests)")
    return _load("triton")()
