"""Admission: waiting requests join the running batch while budget, sequence slots and KV
blocks allow, in the waiting queue's order (FCFS, priority or continuum's program order).

With LoRA, a request whose adapter cannot get a device slot this step is skipped and the scan
goes on (engine_core/lora/slots.py: the per-step adapter budget and its aging guard); the
skipped requests go back to the front of the queue in their order. Every other reason to stop
(budget, KV blocks, the whole-fit gate) stops the scan, as without LoRA.

A mixin of Scheduler (scheduler.py): the attributes below are the scheduler's own, declared
here so this half reads (and type-checks) on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.request import Request, RequestStatus
from engine_core.sched.step_diff import StepDiff
from protocol.codec import pack
from protocol.messages import NewRequestData, ResumedRequestData

if TYPE_CHECKING:
    from engine_core.kv_cache.coordinator import KVCacheBlocks
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
    from engine_core.kv_offload.scheduling import OffloadScheduling
    from engine_core.lora.slots import LoRASlots
    from engine_core.sched.continuum.policy import Continuum
    from engine_core.sched.request_queue import WaitingQueue

RUNNING = RequestStatus.RUNNING


def full_len(req: Request) -> int:
    """KV slots a request holds at the end of its life: every token but the last sampled one
    (it is never fed back), and at least its prompt (a prompt of max_model_len tokens).
    Fixed for the request's life, so the gate can add it on admission and take it back off."""
    n = req.length_limit - 1
    return n if n > req.num_prompt_tokens else req.num_prompt_tokens


class Admission:
    running: list[Request]
    waiting: WaitingQueue
    by_handle: dict[int, Request]
    kv_cache_manager: KVCacheManager
    kv_offload: OffloadScheduling | None
    kv_connector: KVConnectorScheduler | None
    continuum: Continuum | None
    lora: LoRASlots | None
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int
    enable_chunked_prefill: bool
    async_scheduling: bool
    reserve_full_isl: bool
    _full_blocks: int
    _next_handle: int

    def _refusal_reason(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n == 0:
            return "prompt is empty: at least one token is needed"
        if n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len {self.max_model_len}"
        usable = self.kv_cache_manager.num_blocks - 1
        need = self.kv_cache_manager.max_blocks(n)
        if need > usable:
            return (
                f"prompt has {n} tokens and needs {need} KV cache blocks of "
                f"{self.block_size}, but the cache has only {usable}"
            )
        return None

    def _schedule_waiting(self, diff: StepDiff, budget: int) -> None:
        waiting = self.waiting
        running = self.running
        kvm = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        chunked = self.enable_chunked_prefill
        gate = self.reserve_full_isl
        lora = self.lora
        skipped: list[Request] = []
        if lora is not None:
            lora.begin_pass()
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek_request()
            if lora is not None and req.lora is not None and lora.skip(req):
                skipped.append(waiting.pop_request())
                continue
            if req.num_external_computed_tokens:  # KV a prefill engine sent: in its blocks
                hits: KVCacheBlocks = []
                num_hit = req.num_external_computed_tokens
            else:
                hits, num_hit = kvm.get_computed_blocks(req)
                conn = self.kv_connector
                if conn is not None and req.kv_transfer_params is not None:
                    num_ext, load_async = conn.get_num_new_matched_tokens(req, num_hit)
                    if load_async:  # set aside while the KV arrives: it blocks nobody
                        if kvm.allocate_slots(req, num_ext, num_hit, hits,
                                              delay_cache_blocks=True) is None:
                            break
                        waiting.pop_request()
                        conn.update_state_after_alloc(req, num_hit, num_ext)
                        continue
            restore = 0
            if self.kv_offload is not None:
                # blocks after the device hit that come back from the host tier
                r = self.kv_offload.blocks_to_restore(req, num_hit)
                if r is None:  # its prefix is being read from disk: a few steps at most
                    break
                restore = r
                num_hit += restore * self.block_size
            n = req.num_tokens - num_hit
            # without chunking a prompt must fit whole (unless it could never fit)
            if not chunked and budget < n <= self.max_num_batched_tokens:
                break
            cont = self.continuum
            if gate or (cont is not None and running and len(cont.pins)):
                if gate:
                    # on top of the blocks the running requests still need to reach their full
                    # length (only running requests hold block tables)
                    need = (kvm.num_blocks_to_hold(req, full_len(req), hits)
                            + self._full_blocks - kvm.num_held_blocks)
                else:
                    # program-level FCFS over memory: admitted chunk by chunk, the prompt would
                    # take its later chunks' blocks from earlier jobs' pins (a running
                    # request's growth releases any pin before it preempts), so it waits
                    # until the whole prompt fits beside them
                    need = kvm.num_blocks_to_hold(req, req.num_tokens + 1, hits)
                # alone it is admitted anyway: waiting would not make more room
                while running and need > kvm.num_free_blocks:
                    if cont is None or not cont.relieve(req, strict=True):
                        break
                if running and need > kvm.num_free_blocks:
                    break
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, self.max_model_len - num_hit)
            fits = kvm.allocate_slots(req, n, num_hit, hits, num_restored_blocks=restore)
            # pins of later jobs go back first; with nothing running, any pin (waiting for
            # them to expire would leave the engine idle)
            while fits is None and cont is not None and cont.relieve(req, strict=bool(running)):
                fits = kvm.allocate_slots(req, n, num_hit, hits, num_restored_blocks=restore)
            if fits is None:
                break
            if cont is not None:
                cont.on_admitted(req, num_hit)
            if restore:
                self.kv_offload.on_admitted(restore)  # type: ignore[union-attr]
            if gate:
                self._full_blocks += kvm.max_blocks(full_len(req))
            waiting.pop_request()
            if lora is not None and req.lora is not None:
                lora.acquire(req)  # a slot load, if any, goes in this step's diff
            running.append(req)
            req.status = RUNNING
            req.num_computed_tokens = num_hit
            req.num_external_computed_tokens = 0
            block_ids = pack(kvm.get_block_ids(req))
            if req.handle is None:
                req.num_cached_tokens = num_hit
                req.handle = handle = self._next_handle
                self._next_handle += 1
                self.by_handle[handle] = req
                diff.new_reqs.append(
                    NewRequestData(
                        handle=handle,
                        prompt_token_ids=req.packed_prompt,
                        sampling_params=req.sampling_params,
                        block_ids=block_ids,
                        num_computed_tokens=num_hit,
                        num_scheduled_tokens=n,
                    )
                )
                if req.lora is not None:  # its adapter id travels once, beside it
                    diff.lora_handles.append(handle)
                    diff.lora_ids.append(req.lora_int_id)
            else:
                diff.resumed_reqs.append(
                    ResumedRequestData(
                        handle=req.handle,
                        block_ids=block_ids,
                        num_computed_tokens=num_hit,
                        num_scheduled_tokens=n,
                    )
                )
            req.num_computed_tokens = num_hit + n
            if self.async_scheduling and num_hit + n >= req.num_tokens:
                req.num_output_placeholders = 1
            budget -= n
            diff.total += n
        if skipped:
            waiting.prepend_requests(skipped)
