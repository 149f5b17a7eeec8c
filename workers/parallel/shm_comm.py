"""Shared-memory all-reduce / all-gather for the TP ranks of one host (CPU workers).

gloo's TCP collectives cost ~1 ms each on a busy CPU host (socket round trips, its I/O thread,
context switches), and a TP forward pass issues two per layer. Ranks on one host can instead
exchange their parts through one shared memory segment:

    header   world flags (int64, one cache line each): the last sequence number rank r posted
    data     2 buffers x world slots of SLOT_BYTES: slot (seq % 2, r) holds rank r's part

A collective posts this rank's part into its slot of buffer seq % 2 and publishes seq; once
every flag reaches seq, each rank reads all slots (summing in rank order, so every rank gets
the same bits). Two buffers suffice: a rank posts seq + 2 only after every peer posted seq + 1,
which a peer does only after it finished reading seq. Larger tensors go in slot-sized chunks.

The segment file is unlinked as soon as every rank has mapped it, so nothing is left behind
even when a rank is killed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from protocol.liveness import process_running
from workers import cpu_ops

SLOT_BYTES = 1 << 20
FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
WAIT_SLICE_US = 50_000  # return to Python this often (signals, dead-peer checks)


class PeerGone(RuntimeError):
    pass


class ShmCommunicator:
    def __init__(self, rank: int, world: int, name: str, create: bool) -> None:
        lib = cpu_ops.ops()
        if lib is None:
            raise RuntimeError("shared-memory collectives need the CPU kernels")
        self.lib, self.rank, self.world = lib, rank, world
        self.header = world * FLAG_STRIDE * 8
        size = self.header + 2 * world * SLOT_BYTES
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(name, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.seq = 0
        self.pids: list[int] = []

    @classmethod
    def create_for_group(cls, rank: int, world: int) -> ShmCommunicator:
        """Collective over the default process group: rank 0 creates the segment, all map it,
        then it is unlinked."""
        shm_dir = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(
            os.environ.get("TMPDIR", "/tmp"))
        path = str(shm_dir / f"tandem-tp-{uuid.uuid4().hex}")  # only rank 0's is used
        comm = cls(rank, world, path, create=True) if rank == 0 else None
        name: list[str | None] = [path if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        if comm is None:
            comm = cls(rank, world, str(name[0]), create=False)
        pids: list[int] = [0] * world
        dist.all_gather_object(pids, os.getpid())
        comm.pids = [int(p) for p in pids]
        dist.barrier()
        if rank == 0:
            os.unlink(str(name[0]))
        return comm

    def _flag(self, r: int) -> int:
        return self.base + r * FLAG_STRIDE * 8

    def _slot(self, buf: int, r: int) -> int:
        return self.base + self.header + (buf * self.world + r) * SLOT_BYTES

    def _exchange(self, src_ptr: int, nbytes: int) -> int:
        """Post nbytes at src_ptr, wait for every rank; returns the buffer index read."""
        self.seq += 1
        buf = self.seq & 1
        self.lib.tandem_shm_post(self._flag(self.rank), self.seq, self._slot(buf, self.rank),
                                 src_ptr, nbytes)
        while not self.lib.tandem_shm_wait(self._flag(0), FLAG_STRIDE, self.world, self.seq,
                                           WAIT_SLICE_US):
            self._check_peers()
        return buf

    def _check_peers(self) -> None:
        for r, pid in enumerate(self.pids):
            if r != self.rank and not process_running(pid):
                raise PeerGone(f"rank {r} (pid {pid}) died during a shared-memory collective "
                               "(Connection closed by peer)")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (float32 or bfloat16, contiguous)."""
        code = cpu_ops.dtype_code(x.dtype)
        if code is None or not x.is_contiguous():
            raise TypeError(f"shared-memory all-reduce takes contiguous f32/bf16, got {x.dtype}")
        flat = x.view(-1)
        per = SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), per):
            part = flat[start : start + per]
            buf = self._exchange(part.data_ptr(), part.numel() * part.element_size())
            self.lib.tandem_shm_sum(code, part.data_ptr(), self._slot(buf, 0), SLOT_BYTES,
                                    self.world, part.numel())
        return x

    def all_gather_into(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's 2-D x concatenated along ``dim`` (0 or 1), in rank order, exchanged
        in row chunks of at most a slot and copied from the slots straight into the output:
        a step's logits (tens of MB at a large batch) stay off gloo and need no torch.cat."""
        x = x.contiguous()
        rows, cols = x.shape
        row_bytes = cols * x.element_size()
        per = max(1, SLOT_BYTES // max(1, row_bytes))
        out_shape = (rows * self.world, cols) if dim == 0 else (rows, cols * self.world)
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
        for start in range(0, rows, per):
            part = x[start : start + per]
            n = part.shape[0]
            buf = self._exchange(part.data_ptr(), n * row_bytes)
            for r in range(self.world):
                src = torch.frombuffer(self.mm, dtype=x.dtype, count=n * cols,
                                       offset=self._slot(buf, r) - self.base).view(n, cols)
                if dim == 0:
                    out[r * rows + start : r * rows + start + n].copy_(src)
                else:
                    out[start : start + n, r * cols : (r + 1) * cols].copy_(src)
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape and dtype on every rank), in rank order."""
        x = x.contiguous()
        nbytes = x.numel() * x.element_size()
        if nbytes > SLOT_BYTES:
            raise ValueError(f"shared-memory all-gather of {nbytes} B exceeds {SLOT_BYTES} B")
        buf = self._exchange(x.data_ptr(), nbytes)
        out = []
        for r in range(self.world):
            t = torch.empty_like(x)
            ctypes.memmove(t.data_ptr(), self._slot(buf, r), nbytes)
            out.append(t)
        # Read before the next post may reuse this buffer: guaranteed by the two-buffer rule.
        return out


def same_host_group(world: int) -> bool:
    """Whether every rank of the default group runs on this host (collective)."""
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, os.uname().nodename)
    return len(set(hosts)) == 1
