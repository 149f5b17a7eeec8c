"""Attention backends: one interface, chosen once per worker at start-up.

A backend turns a step's AttentionMetadata into an AttentionStep once per forward (whatever
index work the step needs, shared by every layer); each layer then calls the step with its
fused q|k|v projection, and the step rotates q and k, writes the new K/V into the paged cache
and attends. Backends:

- torch  (this file): the portable reference in reference.py, the oracle of the tests;
- cpu    (backends/cpu.py): the C++ kernels of workers/cpu_ops/csrc/, for CPU workers;
- triton (backends/triton.py): Triton kernels, for CUDA workers (and CPU tensors under the
  Triton interpreter, which is how CI tests them).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from workers import cpu_ops, triton_ops
from workers.attention import reference
from workers.attention.reference import AttentionMetadata, GatherScratch
from workers.model.layers import RotaryEmbedding

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpu", "triton")


class AttentionStep(ABC):
    """One forward pass's attention: per-step metadata built once, called by every layer."""

    def __init__(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    @abstractmethod
    def __call__(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                 q_heads: int, kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """qkv [T, (q_heads + 2 * kv_heads) * head_dim] (modified in place) -> [T, q_heads,
        head_dim]: rotary on q and k, the step's K/V stored at meta.slot_mapping, then
        attention over each request's cached context."""


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def begin(self, meta: AttentionMetadata, block_size: int, device: torch.device,
              sliding_window: int = 0) -> AttentionStep:
        """Build the step's per-forward state for the layers of one KV cache group (no
        device-to-host synchronisation). sliding_window > 0: every query at position p sees
        only the keys in (p - sliding_window, p]."""


def split_qkv(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(-1, q_heads, head_dim), k.view(-1, kv_heads, head_dim),
            v.view(-1, kv_heads, head_dim))


class TorchAttentionStep(AttentionStep):
    def __init__(self, meta: AttentionMetadata, plan: reference.AttentionPlan) -> None:
        super().__init__(meta)
        self.plan = plan

    def __call__(self, qkv, positions, rope, q_heads, kv_heads, head_dim, k_cache, v_cache,
                 scale):
        q, k, v = split_qkv(qkv, q_heads, kv_heads, head_dim)
        q, k = rope.forward_torch(positions, q), rope.forward_torch(positions, k)
        reference.write_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        return reference.paged_attention(q, k_cache, v_cache, self.meta, scale, self.plan)


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's context and attends with torch ops (SDPA or matmul/softmax)."""

    name = "torch"

    def __init__(self) -> None:
        self.scratch = GatherScratch()

    def begin(self, meta, block_size, device, sliding_window=0):
        return TorchAttentionStep(meta, reference.plan_attention(
            meta, block_size, device, self.scratch, sliding_window=sliding_window))


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
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on CPU workers, not {device.type}")
        if cpu_ops.ops() is None:
            raise ValueError("attention backend 'cpu' needs the C++ kernels, which are off or "
                             "could not be built (TANDEM_CPU_KERNELS=0 or no compiler)")
        from workers.attention.backends.cpu import CpuAttentionBackend

        return CpuAttentionBackend(head_dim)
    if not triton_ops.available():
        raise ValueError("attention backend 'triton' needs the triton package "
                         "(it ships with CUDA builds of torch)")
    if device.type != "cuda" and not triton_ops.interpreting():
        raise ValueError("attention backend 'triton' runs on CUDA devices (or on CPU tensors "
                         "with TRITON_INTERPRET=1, for tests)")
    from workers.attention.backends.triton import TritonAttentionBackend

    return TritonAttentionBackend()
