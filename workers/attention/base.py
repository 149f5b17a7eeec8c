"""The attention backend interface: what every backend provides (workers/attention/__init__.py
chooses one per worker at start-up, and imports only that one).

A backend turns a step's AttentionMetadata into an AttentionStep once per forward (whatever
index work the step needs, shared by every layer); each layer then calls the step with its
fused q|k|v projection, and the step rotates q and k, writes the new K/V into the paged cache
and attends. Backends:

- torch  (backends/torch.py): the portable reference in reference.py, the oracle of the tests;
- cpu    (backends/cpu.py): the C++ kernels of workers/cpu_ops/csrc/, for CPU workers;
- triton (backends/triton.py): Triton kernels, for CUDA workers (and CPU tensors under the
  Triton interpreter, which is how CI tests them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from workers.attention.reference import AttentionMetadata

if TYPE_CHECKING:
    from workers.model.layers import RotaryEmbedding


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
    """A way to run attention, chosen once per worker; what it can do is stated here, so
    callers ask the backend instead of comparing its name."""

    name: ClassVar[str]
    # a step's kernels read only device memory and host-side numbers fixed by the captured
    # batch shape, so the whole forward can be recorded into a CUDA graph and replayed
    supports_cuda_graphs: ClassVar[bool] = False

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
