"""The KV offload tiers as a rank feature (workers/step_hooks.py): each step's copies between
the device KV cache, the host pool and the disk store, and the verdicts on disk reads.

Slot numbers are the scheduler's, the same on every rank; each rank holds its shard of every
offloaded block.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from protocol.config import EngineConfig
from protocol.kv_transfer import KVLoadResult
from workers.kv_offload.disk import DiskKVStore
from workers.kv_offload.host_pool import HostKVLayout, HostKVPool, KVOffloadExecutor
from workers.parallel.distributed import tp_all_reduce_min
from workers.step_hooks import StepHook

if TYPE_CHECKING:
    import numpy as np

    from protocol.messages import SchedulerOutput
    from workers.runner.batch_inputs import BatchInputs

logger = logging.getLogger(__name__)


class KVOffloadFeature(StepHook):
    def __init__(self, executor: KVOffloadExecutor, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], device: torch.device, num_host_blocks: int,
                 num_disk_blocks: int, bytes_per_block: int) -> None:
        self.executor = executor
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.device = device
        self.num_host_blocks = num_host_blocks
        self.num_disk_blocks = num_disk_blocks
        self.bytes_per_block = bytes_per_block
        self.copy_us = 0.0  # issuing the step in flight's tier copies

    @classmethod
    def build(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], config: EngineConfig,
              rank: int, device: torch.device) -> KVOffloadFeature:
        """This rank's host pool (and disk store) for its shard of every offloaded block."""
        k_caches = [k for k, _ in kv_caches]
        v_caches = [v for _, v in kv_caches]
        layout = HostKVLayout.from_caches(k_caches)
        num_host = HostKVPool.blocks_for(config.kv_offload_memory, layout)
        # pinned on CUDA, so the copies are DMA that overlaps the forward
        pool = HostKVPool(layout, num_host, pin=device.type == "cuda")
        disk = None
        num_disk = 0
        if config.kv_offload_disk and config.kv_offload_disk_size > 0:
            num_disk = DiskKVStore.slots_for(config.kv_offload_disk_size,
                                             layout.nbytes_per_block)
            if num_disk > 0:
                disk = DiskKVStore(config.kv_offload_disk, rank, num_disk,
                                   layout.describe(), layout.nbytes_per_block)
        logger.info("KV offload: %d host blocks (%s), %d disk blocks", num_host,
                    layout.describe(), num_disk)
        return cls(KVOffloadExecutor(pool, disk, device), k_caches, v_caches, device, num_host,
                   num_disk, layout.nbytes_per_block)

    def on_launch(self, so: SchedulerOutput) -> None:
        # after the step before has run (it may write the blocks a store reads) and before
        # this forward (also for a step that carries only copies)
        if so.kv_transfers is None:
            self.copy_us = 0.0
            return
        spent = self.executor.apply_seconds
        self.executor.apply(so.kv_transfers, self.k_caches, self.v_caches)
        self.copy_us = (self.executor.apply_seconds - spent) * 1e6

    def before_forward(self, handles: np.ndarray, inputs: BatchInputs) -> None:
        self.executor.wait_before_forward()  # this step's tier copies land before the forward

    def step_end(self, fields: dict[str, Any]) -> None:
        fields["kv_load"] = self._settle_loads()
        fields["kv_copy_us"] = self.copy_us

    def _settle_loads(self) -> KVLoadResult | None:
        """Disk -> host reads that every rank finished (or any rank failed): the ranks agree
        on each read's state (MIN all-reduce, only in steps with reads in flight), so all of
        them report and act on the same verdicts."""
        slots, states = self.executor.load_states()
        if not slots:
            return None
        agreed = tp_all_reduce_min(states, self.device)
        return self.executor.settle(slots, agreed)

    def census(self, out: dict[str, int]) -> None:
        offload = self.executor
        out["kv_offload.loading"] = len(offload._loading)
        out["kv_offload.bad_slots"] = len(offload._bad)
        if offload.disk is not None:
            out["kv_offload.disk_ops"] = len(offload.disk._last_op)
            out["kv_offload.disk_reads"] = len(offload.disk._reads)

    def close(self) -> None:
        """Finish the copies and disk writes, stop the tiers' threads."""
        self.executor.close()
