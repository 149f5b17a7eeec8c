"""Host arrays to the device without a synchronous copy."""

from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on `device` without a synchronous copy: on CUDA through pinned memory
    (torch's caching host allocator reuses the block once the copy has run) and non_blocking;
    on CPU the array itself, zero-copy."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
