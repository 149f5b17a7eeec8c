"""Worker side of the KV offload tiers: this rank's host pool and the executor of
the copies the scheduler names in each step (protocol/kv_transfer.py).

The host pool holds this rank's shard of each offloaded block for every KV cache tensor:
``[host_blocks, caches, 2 (K, V), block_size, kv_heads, head_dim]`` in the model dtype, pinned
on CUDA so copies are DMA. Slot numbers are the scheduler's and the same on every rank.

One step's copies run in the contract's order: (1) snapshot the host slots that spill to disk,
(2) start disk -> host reads, (3) device -> host, (4) host -> device, and only then the forward.
On CPU (3) and (4) are plain memcpys on the step thread. On CUDA they run on a dedicated
stream, ordered after the work already queued on the compute stream (the forward that wrote
the evicted blocks), and the forward waits on one event: a step with no copies waits for
nothing. The executor refuses (RuntimeError) to restore from a slot whose disk read is in
flight or failed: the scheduler never plans it, so it would be a bug, not a miss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protocol.codec import pack
from protocol.kv_transfer import DecodedTransfers, KVLoadResult, KVTransfers, decode_transfers
from workers.kv_offload.disk import READ_FAILED, READ_OK, DiskKVStore


@dataclass(frozen=True)
class HostKVLayout:
    """Shape of one block's shard on this rank, for every KV cache tensor (``num_caches`` is
    the number of distinct per-layer cache tensors; layers sharing a cache share its entry)."""

    num_caches: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_caches, 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def nbytes_per_block(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def describe(self) -> str:
        """Written (as an id) into disk records so another model, dtype or TP size misses."""
        return f"{self.dtype}|" + ",".join(map(str, self.block_shape))

    @classmethod
    def from_caches(cls, k_caches: Sequence[torch.Tensor]) -> HostKVLayout:
        """From the allocated caches ``[num_blocks, block_size, kv_heads, head_dim]`` each."""
        _, bs, heads, hd = k_caches[0].shape
        return cls(len(k_caches), bs, heads, hd, k_caches[0].dtype)


def layout_for_config(cfg: object, tp_rank: int, tp_size: int, block_size: int,
                      dtype: torch.dtype) -> HostKVLayout:
    """Layout of a rank's shard of a Llama-like model: KV heads split (and padded) as the
    model splits them, one cache per layer."""
    from workers.model.llama import TPLayout

    lay = TPLayout(cfg, tp_rank, tp_size)  # type: ignore[arg-type]
    return HostKVLayout(cfg.num_hidden_layers, block_size, lay.kv_heads,  # type: ignore[attr-defined]
                        cfg.head_dim, dtype)  # type: ignore[attr-defined]


class HostKVPool:
    def __init__(self, layout: HostKVLayout, num_blocks: int, pin: bool = False) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.data = torch.zeros((num_blocks, *layout.block_shape), dtype=layout.dtype,
                                pin_memory=pin)

    @staticmethod
    def blocks_for(nbytes: int, layout: HostKVLayout) -> int:
        """Host slots that ``nbytes`` (kv_offload_memory, per rank) hold."""
        return max(nbytes, 0) // layout.nbytes_per_block

    def slot_bytes(self, slot: int) -> np.ndarray:
        """A writable uint8 view of one slot (shares memory with the pool)."""
        return self.data[slot].view(-1).view(torch.uint8).numpy()


class KVOffloadExecutor:
    def __init__(self, pool: HostKVPool, disk: DiskKVStore | None = None,
                 device: torch.device | None = None) -> None:
        self.pool = pool
        self.disk = disk
        self.device = device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._loading: set[int] = set()  # host slots a disk read is filling
        self._bad: set[int] = set()  # host slots whose read failed (until rewritten)
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._event: torch.cuda.Event | None = None  # copies of the last step with copies
        self._wait_pending = False  # the next forward must wait for _event
        # time the step thread spent in apply (on CUDA: issuing the copies, not running
        # them), for the stats next to the scheduler's byte counters
        self.apply_seconds = 0.0

    def apply(self, transfers: KVTransfers | DecodedTransfers, k_caches: Sequence[torch.Tensor],
              v_caches: Sequence[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        try:
            self._apply(transfers, k_caches, v_caches)
        finally:
            self.apply_seconds += time.perf_counter() - t0

    def _apply(self, transfers: KVTransfers | DecodedTransfers,
               k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> None:
        t = decode_transfers(transfers) if isinstance(transfers, KVTransfers) else transfers
        if len(k_caches) != self.pool.layout.num_caches or len(v_caches) != len(k_caches):
            raise ValueError(f"{len(k_caches)} caches, the host pool has "
                             f"{self.pool.layout.num_caches}")
        self._check(t)  # before anything runs: a bad plan is refused whole
        if t.host_to_disk or t.disk_to_host:
            self._host_quiet()
        self._spill(t)
        self._start_reads(t)
        if not (t.device_to_host or t.host_to_device):
            return
        if self.cuda:
            self._copy_cuda(t, k_caches, v_caches)
        else:
            self._copy_cpu(t, k_caches, v_caches)
        for _, s in t.device_to_host:
            self._bad.discard(s)

    def _check(self, t: DecodedTransfers) -> None:
        loading = self._loading.union(s for _, s in t.disk_to_host)
        for _, s in t.device_to_host:
            if s in loading:
                raise RuntimeError(f"device -> host copy into host slot {s} while it loads")
        for s, _ in t.host_to_device:
            if s in loading or s in self._bad:
                raise RuntimeError(f"restore from host slot {s}, whose disk read is "
                                   f"{'in flight' if s in loading else 'failed'}")
        n = self.pool.num_blocks
        if any(not 0 <= s < n for s in (*(s for _, s in t.device_to_host),
                                        *(s for s, _ in t.host_to_device),
                                        *(s for s, _ in t.host_to_disk),
                                        *(s for _, s in t.disk_to_host))):
            raise RuntimeError(f"a host slot outside [0, {n}) in the step's KV copies")

    def _host_quiet(self) -> None:
        # The CPU is about to read (spill) or a thread to write (disk read) host slots that
        # earlier steps' DMA may still be writing or reading: wait for those copies (short;
        # only in steps that touch the disk).
        if self._event is not None:
            self._event.synchronize()

    def _spill(self, t: DecodedTransfers) -> None:
        if not t.host_to_disk:
            return
        if self.disk is None:
            raise RuntimeError("host -> disk copies without a disk tier (--kv-offload-disk)")
        for (s, x), tag in zip(t.host_to_disk, t.host_to_disk_tags, strict=True):
            self.disk.write(x, tag, self.pool.slot_bytes(s).tobytes())  # snapshot, now

    def _start_reads(self, t: DecodedTransfers) -> None:
        if not t.disk_to_host:
            return
        if self.disk is None:
            raise RuntimeError("disk -> host copies without a disk tier (--kv-offload-disk)")
        for (x, s), tag in zip(t.disk_to_host, t.disk_to_host_tags, strict=True):
            self._loading.add(s)
            self._bad.discard(s)
            self.disk.read_into(x, tag, self.pool.slot_bytes(s), host_slot=s)

    def _copy_cpu(self, t: DecodedTransfers, k_caches: Sequence[torch.Tensor],
                  v_caches: Sequence[torch.Tensor]) -> None:
        host = self.pool.data
        if t.device_to_host:
            src = torch.tensor([d for d, _ in t.device_to_host], dtype=torch.long)
            dst = torch.tensor([s for _, s in t.device_to_host], dtype=torch.long)
            blocks = torch.stack([torch.stack((k.index_select(0, src), v.index_select(0, src)), 1)
                                  for k, v in zip(k_caches, v_caches, strict=True)], 1)
            host.index_copy_(0, dst, blocks)
        if t.host_to_device:
            src = torch.tensor([s for s, _ in t.host_to_device], dtype=torch.long)
            dst = torch.tensor([d for _, d in t.host_to_device], dtype=torch.long)
            blocks = host.index_select(0, src)
            for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
                k.index_copy_(0, dst, blocks[:, i, 0])
                v.index_copy_(0, dst, blocks[:, i, 1])

    # ---- CUDA (not exercised by the CPU tests: keep it small) -----------------------------

    def _copy_cuda(self, t: DecodedTransfers, k_caches: Sequence[torch.Tensor],
                   v_caches: Sequence[torch.Tensor]) -> None:
        from workers.runner.host_copy import to_device

        assert self._stream is not None
        host, stream = self.pool.data, self._stream
        # after every kernel already queued: the forward that wrote the evicted blocks, and
        # the last reads of blocks about to be overwritten by restores
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if t.device_to_host:
                src = to_device(np.array([d for d, _ in t.device_to_host], np.int64),
                                self.device)
                # gather on the device (allocated on this stream, so its memory is not reused
                # before these copies finish), then one DMA per block into pinned slots
                blocks = torch.stack([torch.stack((k.index_select(0, src),
                                                   v.index_select(0, src)), 1)
                                      for k, v in zip(k_caches, v_caches, strict=True)], 1)
                for i, (_, s) in enumerate(t.device_to_host):
                    host[s].copy_(blocks[i], non_blocking=True)
            if t.host_to_device:
                dst = to_device(np.array([d for _, d in t.host_to_device], np.int64),
                                self.device)
                staged = torch.empty((len(t.host_to_device), *self.pool.layout.block_shape),
                                     dtype=host.dtype, device=self.device)
                for i, (s, _) in enumerate(t.host_to_device):
                    staged[i].copy_(host[s], non_blocking=True)
                for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
                    k.index_copy_(0, dst, staged[:, i, 0])
                    v.index_copy_(0, dst, staged[:, i, 1])
            self._event = torch.cuda.Event()
            self._event.record(stream)
        self._wait_pending = True

    def wait_before_forward(self) -> None:
        """Make the forward wait (on the device, not the host) for this step's copies: its
        restored blocks must be in place and its evicted blocks read before it overwrites
        them. Nothing to wait for on CPU, or in a step without copies."""
        if self._wait_pending and self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        self._wait_pending = False

    # ---- disk reads ------------------------------------------------------------------------

    def load_states(self) -> tuple[list[int], list[int]]:
        """(host slots with a disk read in flight, sorted; their READ_* states), changing
        nothing. Every rank got the same reads, so the slot lists agree; under TP the ranks
        take the elementwise minimum of the states (one small all-reduce, only in steps with
        reads in flight) and each passes it to ``settle``: a read that failed on any rank
        is failed everywhere, and one still pending anywhere waits."""
        if self.disk is None:
            return [], []
        slots = self.disk.reads_in_flight
        return slots, [self.disk.read_state(s) for s in slots]

    def settle(self, slots: Sequence[int], states: Sequence[int]) -> KVLoadResult | None:
        """Act on the agreed states; the report for the scheduler, None when nothing settled."""
        done = [s for s, st in zip(slots, states, strict=True) if st == READ_OK]
        failed = [s for s, st in zip(slots, states, strict=True) if st == READ_FAILED]
        if not (done or failed):
            return None
        disk = self.disk
        assert disk is not None  # only disk reads settle here
        for s in (*done, *failed):
            disk.forget(s)
            self._loading.discard(s)
        self._bad.update(failed)  # the bytes there may be partial: never restore them
        return KVLoadResult(done_host_slots=pack(done), failed_host_slots=pack(failed))

    def poll_loads(self) -> KVLoadResult | None:
        """``settle`` on this rank's own states (TP=1, tests)."""
        return self.settle(*self.load_states())

    def synchronize(self) -> None:
        """Wait for every copy and disk operation (tests, shutdown)."""
        if self._event is not None:
            self._event.synchronize()
        if self.disk is not None:
            self.disk.wait()

    def close(self) -> None:
        self.synchronize()
        if self.disk is not None:
            self.disk.close()


def host_bytes(t: torch.Tensor) -> np.ndarray:
    """uint8 view of a CPU tensor (tests compare blocks bit for bit, bfloat16 included)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy()
