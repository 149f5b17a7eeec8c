"""The same-host shared-memory path: a prefill rank on CPU keeps its KV caches in one memfd,
and a decode rank on the same machine maps it read-only (``/proc/<pid>/fd/<fd>``) and copies
the blocks straight into its own caches: one copy, no socket, no staging.

The memfd has no name in the file system, so nothing is left behind when the prefill rank
dies, however it dies; a decode rank that tries to map a dead rank's memory fails at once
(its /proc entry is gone). Block-level safety (never reading a block after its lease ended)
is the transport's: it asks the block server before and after the copy.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from workers.model.llama import LlamaForCausalLM


class SharedCaches:
    """A prefill rank's caches, back to back in one memfd; ``tensors[i]`` replaces the model's
    i-th cache tensor (same shape and dtype)."""

    def __init__(self, like: Sequence[torch.Tensor]) -> None:
        shape, dtype = tuple(like[0].shape), like[0].dtype
        self.cache_bytes = int(np.prod(shape)) * dtype.itemsize
        total = max(1, self.cache_bytes * len(like))
        self.fd = os.memfd_create("tandem-kv", 0)
        os.ftruncate(self.fd, total)
        self.map = mmap.mmap(self.fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        flat = torch.frombuffer(self.map, dtype=torch.uint8, count=total)
        self.tensors = [flat[i * self.cache_bytes:(i + 1) * self.cache_bytes].view(dtype)
                        .view(shape) for i in range(len(like))]
        for t, src in zip(self.tensors, like, strict=True):
            t.copy_(src)

    def close(self) -> None:
        self.tensors = []
        try:
            self.map.close()
        except BufferError:  # a tensor view still exists: the OS frees it at exit
            pass
        os.close(self.fd)


def rebind_model_caches(model: LlamaForCausalLM, tensors: list[torch.Tensor]) -> None:
    """Point every attention layer (and model.kv_caches) at ``tensors``: [k0, v0, k1, v1, ..]
    in the order of model.kv_caches; layer i takes the pair of its cache slot, as
    allocate_kv_cache gave it."""
    pairs = [(tensors[2 * i], tensors[2 * i + 1]) for i in range(len(tensors) // 2)]
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        attn.k_cache, attn.v_cache = pairs[model.layer_slot[i]]
    model.kv_caches = pairs


class RemoteCaches:
    """A prefill rank's caches seen from a decode rank on the same machine (read-only)."""

    def __init__(self, pid: int, fd: int, num_caches: int, shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        cache_bytes = int(np.prod(shape)) * dtype.itemsize
        total = cache_bytes * num_caches
        path = f"/proc/{pid}/fd/{fd}"
        f = os.open(path, os.O_RDONLY)  # FileNotFoundError: that rank is gone
        try:
            if os.fstat(f).st_size < total:
                raise OSError(f"{path} holds {os.fstat(f).st_size} bytes, expected {total}")
            self.map = mmap.mmap(f, total, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(f)
        # read-only memory: torch warns about it, never writes through these views
        arr = np.frombuffer(self.map, dtype=np.uint8, count=total)
        flat = torch.from_numpy(arr.view(np.dtype(str(dtype).removeprefix("torch."))
                                         if dtype != torch.bfloat16 else np.int16))
        if dtype == torch.bfloat16:
            flat = flat.view(torch.bfloat16)
        per = cache_bytes // dtype.itemsize
        self.tensors = [flat[i * per:(i + 1) * per].view(shape) for i in range(num_caches)]

    def close(self) -> None:
        self.tensors = []
        try:
            self.map.close()
        except BufferError:
            pass
