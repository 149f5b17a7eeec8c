"""The Scheduler's use of the KV offload tiers, kept out of sched/scheduler.py.

Three moments of a step touch the tiers:

- admission: after the device prefix-cache hit, the blocks that follow it may be in the host
  tier (restored into fresh device blocks by this step's copies, so their prefill is skipped)
  or on disk (promoted to the host first: the request waits a few steps for the workers to
  confirm the reads, then goes with whatever is ready);
- preemption: the victim's computed full blocks are copied to free host slots before its
  device blocks are freed, so it resumes by restoring instead of recomputing;
- the end of schedule(): the step's copies leave with the step plan, exactly once per step.

The KVOffloadManager keeps the accounting; this file only decides when to call it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine_core.kv_offload import KVOffloadManager
from protocol.codec import unpack
from protocol.kv_transfer import KVLoadResult, KVTransfers

if TYPE_CHECKING:
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.request import Request

# steps a request waits at the head of the queue for disk -> host reads of its prefix before
# it is admitted with the blocks that are ready (a step count, not a time: the trace's replay
# must take the same decisions)
MAX_PREFETCH_WAIT_STEPS = 32


class OffloadScheduling:
    def __init__(self, offload: KVOffloadManager, kvm: KVCacheManager) -> None:
        self.offload = offload
        self.kvm = kvm
        self.block_size = kvm.block_size
        self._waits: dict[str, int] = {}  # request id -> steps waited for disk reads
        self.num_restored_tokens = 0  # prefill tokens skipped thanks to a tier hit
        self.num_restored_requests = 0
        self.num_prefetch_waits = 0  # (request, step) pairs that waited for disk reads
        self.num_preempt_offloaded = 0  # blocks copied out of preempted requests
        self.plan_seconds = 0.0  # time the scheduler spent in tier accounting
        self.copy_seconds = 0.0  # time rank 0 spent in the tiers' copies (workers' report)

    def blocks_to_restore(self, req: Request, num_hit_tokens: int) -> int | None:
        """How many blocks after the device hit of ``num_hit_tokens`` to restore from the
        host tier (pinned for this step), or None: wait, disk reads of the prefix are under
        way. Call right before allocate_slots."""
        t0 = time.perf_counter()
        try:
            n_dev = num_hit_tokens // self.block_size
            lk = self.kvm.get_offloaded_prefix(req, n_dev)
            rid = req.request_id
            if lk.num_blocks == 0:
                self._waits.pop(rid, None)
                return 0
            hashes = req.block_hashes[n_dev : n_dev + lk.num_blocks]
            if lk.num_ready < lk.num_blocks:
                waited = self._waits.get(rid, 0)
                if waited < MAX_PREFETCH_WAIT_STEPS:
                    # starts reads of the disk-only blocks; blocks already loading are skipped
                    self.offload.prefetch(hashes)
                    self._waits[rid] = waited + 1
                    self.num_prefetch_waits += 1
                    return None
            self._waits.pop(rid, None)
            return self.offload.reserve_restore(hashes[: lk.num_ready])
        finally:
            self.plan_seconds += time.perf_counter() - t0

    def on_admitted(self, num_restored_blocks: int) -> None:
        if num_restored_blocks:
            self.num_restored_tokens += num_restored_blocks * self.block_size
            self.num_restored_requests += 1
            self.kvm.prefix_cache_hits += num_restored_blocks * self.block_size

    def on_preempt(self, req: Request, num_computed_tokens: int) -> None:
        """Before the victim's blocks are freed: copy its computed full blocks to free host
        slots (``num_computed_tokens`` counts only tokens of earlier steps)."""
        t0 = time.perf_counter()
        k = min(num_computed_tokens // self.block_size, len(req.block_hashes))
        if k > 0:
            ids = [b.block_id for b in self.kvm.get_blocks(req)[:k]]
            copies = self.offload.offload_request(req.block_hashes[:k], ids)
            self.num_preempt_offloaded += len(copies)
        self.plan_seconds += time.perf_counter() - t0

    def forget(self, request_id: str) -> None:
        self._waits.pop(request_id, None)

    @property
    def waiting_for_loads(self) -> bool:
        """Disk reads are in flight: the core must keep stepping (briefly) to learn of them."""
        return self.offload.num_loads_in_flight > 0

    def take_transfers(self) -> KVTransfers | None:
        return self.offload.take_transfers()

    def complete_loads(self, result: KVLoadResult) -> list[list[int]]:
        """Apply the workers' disk-read report; returns it unpacked (for the trace)."""
        done, failed = unpack(result.done_host_slots), unpack(result.failed_host_slots)
        self.offload.complete_loads(done, failed)
        return [done, failed]

    def stats(self) -> dict[str, float]:
        out = self.offload.stats()
        out["kv_offload_restored_tokens"] = self.num_restored_tokens
        out["kv_offload_restored_requests"] = self.num_restored_requests
        out["kv_offload_prefetch_waits"] = self.num_prefetch_waits
        out["kv_offload_preempt_offloaded"] = self.num_preempt_offloaded
        out["kv_offload_plan_s"] = self.plan_seconds
        out["kv_offload_copy_s"] = self.copy_seconds
        return out


def make_offload_manager(num_host_blocks: int, num_disk_blocks: int, bytes_per_block: int,
                         num_kv_groups: int) -> KVOffloadManager | None:
    """The tiers' accounting, or None when there is no host tier or the model has several KV
    cache groups (the tiers restore full-attention group 0 only, so a hybrid model would
    recompute its window groups' blocks: not supported yet)."""
    if num_host_blocks <= 0 or num_kv_groups != 1:
        return None
    return KVOffloadManager(num_host_blocks, num_disk_blocks, bytes_per_block)
