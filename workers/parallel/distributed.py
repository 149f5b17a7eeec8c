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

from workers.parallel.shm_comm import SLOT_BYTES, ShmCommunicator

logger = logging.getLogger(__name__)

# Shared-memory collectives between the CPU ranks of one host (shm_comm.py), set up by
# init_distributed; None: torch.distributed (gloo / NCCL) carries them.
_shm: ShmCommunicator | None = None


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


def init_distributed(device: str = "auto", timeout_s: float = 60,
                     dtype: str = "float32") -> DistEnv:
    """Join the process group described by RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT.

    NCCL on CUDA (LOCAL_RANK picks the GPU), gloo on CPU. "auto" is CUDA only when every rank on
    this node (LOCAL_WORLD_SIZE) has a GPU of its own, else CPU (workers/device_check.py); a rank
    that cannot run raises DeviceError naming itself. A world of one needs no group, but an
    already initialized group is reused as is.
    """
    from workers.device_check import check_rank

    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world_size)
    device = check_rank(device, dtype, rank=rank, local_rank=local_rank, tp_size=world_size,
                        local_ranks=local_world)
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if world_size > 1 and not dist.is_initialized():
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(var):
                raise RuntimeError(f"WORLD_SIZE={world_size} but {var} is not set")
        # NCCL binds the group to this rank's device up front; gloo takes no device
        dist.init_process_group(
            backend=backend, init_method="env://", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout_s), device_id=dev if backend == "nccl" else None,
        )
    if dist.is_initialized():
        backend = str(dist.get_backend())
        if backend == "gloo":
            _setup_shm(rank, world_size)
    return DistEnv(rank=rank, world_size=world_size, local_rank=local_rank, device=dev,
                   backend=backend)


def _setup_shm(rank: int, world_size: int) -> None:
    """Use shared memory for the TP collectives when every rank is on this host (collective:
    every rank takes the same decision, since the inputs are all-gathered)."""
    global _shm
    from workers import cpu_ops
    from workers.parallel import shm_comm

    wanted = os.environ.get("TANDEM_SHM_COLLECTIVES", "1") != "0"
    able = [bool(wanted and cpu_ops.ops() is not None)] * world_size
    dist.all_gather_object(able, able[0])
    if world_size > 1 and all(able) and shm_comm.same_host_group(world_size):
        _shm = shm_comm.ShmCommunicator.create_for_group(rank, world_size)
        if rank == 0:
            logger.info("TP collectives over shared memory (%d ranks on one host)", world_size)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_world_size() -> int:
    return _world()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP ranks (in place); a no-op at world size 1."""
    if _world() > 1:
        if _shm is not None and x.dtype in (torch.float32, torch.bfloat16) and x.is_contiguous():
            return _shm.all_reduce(x)
        dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order; x itself at world size 1."""
    world = _world()
    if world == 1:
        return x
    x = x.contiguous()
    if (_shm is not None and x.dim() == 2 and x.shape[1] * x.element_size() <= SLOT_BYTES
            and dim in (0, 1, -1)):
        # any size, in slot-sized row chunks, written straight into the concatenation
        return _shm.all_gather_into(x, dim % 2)
    if _shm is not None and x.numel() * x.element_size() <= SLOT_BYTES:
        parts = _shm.all_gather(x)
    else:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)



def tp_all_reduce_min(values: list[int], device: torch.device) -> list[int]:
    """Elementwise minimum of a small int list over the TP ranks (the KV offload tiers'
    disk-read verdicts); the list itself at world size 1. Every rank must call it in the same
    step with a list of the same length. Through torch.distributed, not the shared-memory
    path: it carries only sums, and this runs only in steps with disk reads in flight."""
    if _world() == 1 or not values:
        return list(values)
    # NCCL reduces device tensors only; gloo takes CPU ones
    dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [int(v) for v in t.tolist()]
