"""Triton kernels for the CUDA path: paged attention, the rotary + KV-cache write, RMSNorm with
the residual add, SiLU-and-mul.

Triton ships with every CUDA build of torch. On a machine without a GPU the same kernels run on
CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, read when a kernel module is first
imported), which is how CI tests them against the torch reference path.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def available() -> bool:
    """The triton package imports (it may be absent on CPU-only installs)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def applies(t: torch.Tensor) -> bool:
    """Whether the fused Triton kernels should run on this tensor: CUDA tensors (CPU tensors
    only under the interpreter, where tests ask for them explicitly)."""
    return t.is_cuda and available()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
