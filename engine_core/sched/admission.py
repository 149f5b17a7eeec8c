"""Admission: waiting requests join the running batch while budget, sequence slots and KV
blocks allow, in the waiting queue's order (FCFS, priority or continuum's program order).

A request the slot policy passes over (LoRA: its adapter gets no device slot this pass,
engine_core/lora/slots.py) is skipped and the scan goes on; the skipped requests go back to
the front of the queue in their order. A request whose prompt KV another engine holds is set
aside while it loads (P/D). Every other reason to stop (budget, KV blocks, a prefix still
being read from disk, the whole-fit gate) stops the scan.

The features' decisions are calls on objects that are always present (features.py): the
slot policy, the restorer, the pin relief, the remote KV and the encoder plan (images); each
is a no-op when its feature is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.request import Request
from engine_core.sched.features import NoRemoteKV, RemoteKV
from engine_core.sched.step_diff import StepDiff
from protocol.codec import pack
from protocol.messages import NewRequestData, ResumedRequestData

if TYPE_CHECKING:
    from engine_core.kv_cache.coordinator import KVCacheBlocks
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.sched.features import EncoderPlan, Hooks, PinRelief, Restorer, SlotPolicy
    from engine_core.sched.request_queue import WaitingQueue
    from engine_core.sched.running_set import RunningSet
    from protocol.config import EngineConfig


class WaitingAdmission:
    def __init__(
        self,
        config: EngineConfig,
        waiting: WaitingQueue,
        running: RunningSet,
        kvm: KVCacheManager,
        by_handle: dict[int, Request],
        max_model_len: int,
        max_num_batched_tokens: int,
        slots: SlotPolicy,
        restorer: Restorer,
        pins: PinRelief,
        hooks: Hooks,
        encoder: EncoderPlan,
    ) -> None:
        self.waiting = waiting
        self.running = running
        self.kvm = kvm
        self.by_handle = by_handle  # requests the workers know, by their wire handle
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.long_prefill_token_threshold = max(0, config.long_prefill_token_threshold)
        self.enable_chunked_prefill = config.enable_chunked_prefill
        # a request whose scheduled tokens reach its end gets an output placeholder
        self.async_scheduling = config.async_scheduling
        self.slots = slots
        self.restorer = restorer
        self.pins = pins
        self.hooks = hooks
        self.encoder = encoder
        # the KV connector's loads: set when the engine core attaches a connector
        self.remote: RemoteKV = NoRemoteKV()
        self.next_handle = 0

    def refusal_reason(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if n == 0:
            return "prompt is empty: at least one token is needed"
        if n > self.max_model_len:
            return f"prompt has {n} tokens, more than max_model_len {self.max_model_len}"
        usable = self.kvm.num_blocks - 1
        need = self.kvm.max_blocks(n)
        if need > usable:
            return (
                f"prompt has {n} tokens and needs {need} KV cache blocks of "
                f"{self.block_size}, but the cache has only {usable}"
            )
        return None

    def schedule(self, diff: StepDiff, budget: int) -> None:
        """Admit waiting requests into ``diff`` within ``budget`` tokens."""
        waiting = self.waiting
        running_set = self.running
        running = running_set.requests
        kvm = self.kvm
        threshold = self.long_prefill_token_threshold
        chunked = self.enable_chunked_prefill
        slots = self.slots
        restorer = self.restorer
        pins = self.pins
        remote = self.remote
        encoder = self.encoder
        on_admitted = self.hooks.on_admitted
        skipped: list[Request] = []
        slots.begin_pass()
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek_request()
            if slots.skip(req):
                skipped.append(waiting.pop_request())
                continue
            if req.num_external_computed_tokens:  # KV a prefill engine sent: in its blocks
                hits: KVCacheBlocks = []
                num_hit = req.num_external_computed_tokens
            else:
                hits, num_hit = kvm.get_computed_blocks(req)
                num_ext = remote.loads_async(req, num_hit)
                if num_ext:  # set aside while the KV arrives: it blocks nobody
                    if kvm.allocate_slots(req, num_ext, num_hit, hits,
                                          delay_cache_blocks=True) is None:
                        break
                    waiting.pop_request()
                    remote.on_set_aside(req, num_hit, num_ext)
                    continue
            # blocks after the device hit that come back from the host tier
            restore = restorer.blocks_to_restore(req, num_hit)
            if restore is None:  # its prefix is being read from disk: a few steps at most
                break
            num_hit += restore * self.block_size
            n = req.num_tokens - num_hit
            # without chunking a prompt must fit whole (unless it could never fit)
            if not chunked and budget < n <= self.max_num_batched_tokens:
                break
            need = running_set.blocks_to_fit(req, hits)
            # alone it is admitted anyway: waiting would not make more room
            while running and need > kvm.num_free_blocks:
                if not pins.relieve(req, strict=True):
                    break
            if running and need > kvm.num_free_blocks:
                break
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, self.max_model_len - num_hit)
            images = None
            if encoder.encodes and num_hit < req.mm_end:  # the chunk may cross an image
                n, images = encoder.plan(req, num_hit, n)
                if n <= 0:  # its next image does not fit this step: it waits its turn
                    break
            fits = kvm.allocate_slots(req, n, num_hit, hits, num_restored_blocks=restore)
            # pins of later jobs go back first; with nothing running, any pin (waiting for
            # them to expire would leave the engine idle)
            while fits is None and pins.relieve(req, strict=bool(running)):
                fits = kvm.allocate_slots(req, n, num_hit, hits, num_restored_blocks=restore)
            if fits is None:
                break
            if images:
                encoder.commit(req, images)
            for hook in on_admitted:
                hook(req, num_hit)
            restorer.on_restored(restore)
            waiting.pop_request()
            running_set.join(req)
            req.num_computed_tokens = num_hit
            req.num_external_computed_tokens = 0
            block_ids = pack(kvm.get_block_ids(req))
            handle = req.handle
            if handle is None:
                req.num_cached_tokens = num_hit
                req.handle = handle = self.next_handle
                self.next_handle += 1
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
                        handle=handle,
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
