"""The running set: the requests that hold block tables and run each step, in admission order,
and the whole-fit gate's account of the blocks they will need at their full length.

The one owner of both: a request joins through ``join`` and leaves through ``leave`` (finished
or preempted alike), so the gate's count and the adapter slots change in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine_core.kv_cache.coordinator import KVCacheBlocks
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.sched.features import PinRelief, SlotPolicy

RUNNING = RequestStatus.RUNNING


def full_len(req: Request) -> int:
    """KV slots a request holds at the end of its life: every token but the last sampled one
    (it is never fed back), and at least its prompt (a prompt of max_model_len tokens).
    Fixed for the request's life, so the gate can add it on admission and take it back off."""
    n = req.length_limit - 1
    return n if n > req.num_prompt_tokens else req.num_prompt_tokens


def handle_of(req: Request) -> int:
    """The wire handle of a request the workers know: given on its first admission and kept
    until it finishes, so every running (and every preempted) request has one."""
    handle = req.handle
    assert handle is not None, f"{req} has no handle"
    return handle


class RunningSet:
    def __init__(self, kvm: KVCacheManager, slots: SlotPolicy, pins: PinRelief,
                 reserve_full_isl: bool) -> None:
        self.requests: list[Request] = []
        self.kvm = kvm
        self.slots = slots
        self.pins = pins
        # scheduler_reserve_full_isl: admitted requests never preempt each other
        self.reserve_full_isl = reserve_full_isl
        self.full_blocks = 0  # blocks the running requests need at their full length

    def __len__(self) -> int:
        return len(self.requests)

    def join(self, req: Request) -> None:
        """``req`` was admitted (its blocks are allocated)."""
        if self.reserve_full_isl:
            self.full_blocks += self.kvm.max_blocks(full_len(req))
        self.slots.acquire(req)  # a slot load, if any, goes in this step's diff
        self.requests.append(req)
        req.status = RUNNING

    def leave(self, req: Request) -> None:
        """``req`` stops running (finished or preempted): its share of the gate and its
        adapter's slot go back. The list is pruned by the caller (``remove_at``, ``prune``),
        which may batch several leaves into one pass."""
        if self.reserve_full_isl:
            self.full_blocks -= self.kvm.max_blocks(full_len(req))
        self.slots.release(req)

    def remove_at(self, index: int) -> Request:
        req = self.requests.pop(index)
        self.leave(req)
        return req

    def prune(self) -> None:
        """Drop the requests that left (their status is no longer RUNNING), in place."""
        self.requests[:] = [r for r in self.requests if r.status == RUNNING]

    def blocks_to_fit(self, req: Request, hits: KVCacheBlocks) -> int:
        """Free blocks ``req`` needs before it is admitted (0: no whole-fit check)."""
        if self.reserve_full_isl:
            # on top of the blocks the running requests still need to reach their full
            # length (only running requests hold block tables)
            kvm = self.kvm
            return (kvm.num_blocks_to_hold(req, full_len(req), hits)
                    + self.full_blocks - kvm.num_held_blocks)
        return self.pins.blocks_to_fit(req, hits, bool(self.requests))

    def check(self) -> None:
        if not self.reserve_full_isl:
            return
        kvm = self.kvm
        full = sum(kvm.max_blocks(full_len(r)) for r in self.requests)
        assert self.full_blocks == full, (self.full_blocks, full)
        # (a request too big for the whole cache runs alone: nothing else is admitted)
        held = kvm.num_held_blocks
        if len(self.requests) > 1:
            assert full - held <= kvm.num_free_blocks, "admitted requests can run out of KV"
