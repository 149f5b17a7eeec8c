"""Pins: a finished turn's prefix-cache blocks kept referenced until the job's next turn
claims them, the TTL expires, or memory pressure takes them back.

A pin is one more holder of each block (ref_cnt + 1), exactly like a request's table, so the
block pool's accounting needs nothing new: releasing a pin drops those references and blocks
that reach 0 join the free queue as cached, evictable blocks (offered to the host tier when
reused, like any evicted prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool

RETURNED = float("-inf")  # expected_return of a pin whose next turn has already arrived


@dataclass(slots=True, eq=False)
class Pin:
    job_id: str
    blocks: list[KVCacheBlock]  # every group's pinned blocks, each group in prefix order
    num_tokens: int  # tokens the pinned prefix covers
    program_key: float  # the job's first arrival: its place in program-level FCFS
    expires_at: float
    expected_return: float


class PinTable:
    """At most one pin per job."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.pins: dict[str, Pin] = {}
        self.num_blocks = 0  # block references the pins hold

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.pins

    def __len__(self) -> int:
        return len(self.pins)

    def get(self, job_id: str) -> Pin | None:
        return self.pins.get(job_id)

    def hold(self, pin: Pin) -> None:
        assert pin.job_id not in self.pins, f"job {pin.job_id!r} already holds a pin"
        self.pool.touch(pin.blocks)
        self.pins[pin.job_id] = pin
        self.num_blocks += len(pin.blocks)

    def release(self, job_id: str) -> Pin | None:
        pin = self.pins.pop(job_id, None)
        if pin is not None:
            # tail first, as a request frees: the shared prefix is evicted last
            self.pool.free_blocks(reversed(pin.blocks))
            self.num_blocks -= len(pin.blocks)
        return pin

    def expired(self, now: float) -> list[str]:
        return [j for j, p in self.pins.items() if p.expires_at <= now]

    def by_latest_return(self) -> list[Pin]:
        """Release order under pressure: the pin whose job is expected back last first."""
        return sorted(self.pins.values(), key=lambda p: (-p.expected_return, -p.program_key))

    def tables(self) -> Iterator[list[KVCacheBlock]]:
        """Each pin's blocks, as holders for the block-pool invariants."""
        for pin in self.pins.values():
            yield pin.blocks
