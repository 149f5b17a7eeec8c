"""torch.distributed set-up from torchrun's variables, and the two TP collectives the model uses.

The TP group is the whole world: every worker holds one shard of one model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init_distributed(device: str = "auto", timeout_s: float = 60) -> DistEnv:
    """Join the process group described by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.

    NCCL on CUDA (LOCAL_RANK picks the GPU), gloo on CPU. A world of one needs no group, but an
    already initialized group is reused as is.
    """
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but CUDA is not available")
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    elif device == "cpu":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        raise ValueError(f"unknown device {device!r}; expected auto, cpu or cuda")
    if world_size > 1 and not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(var):
                raise RuntimeError(f"WORLD_SIZE={world_size} but {var} is not set")
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(
            backend=backend, init_method="env://", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s), **kwargs,
        )
    if dist.is_initialized():
        backend = str(dist.get_backend())
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev,
                   backend=backend)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_world_size() -> int:
    return _world()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP ranks (in place); a no-op at world size 1."""
    if _world() > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order; x itself at world size 1."""
    world = _world()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
