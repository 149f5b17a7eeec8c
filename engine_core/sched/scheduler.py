"""The Scheduler: one token budget per step shared by every request (vLLM v1 semantics).

Each request has ``num_computed_tokens`` and ``num_tokens_with_spec``; a step gives each
request part of the gap between them. Decodes (gap 1), prefill chunks (gap = rest of the
prompt), recompute after preemption and speculative drafts are all the same rule.

The step's two passes live beside this file: running_pass.py (running requests, preemption)
and admission.py (waiting requests); applying the model's output (update_from_output) lives in
update.py.

Order: running requests first, in admission order; on KV exhaustion the scheduler preempts
(recompute) and retries. Waiting requests are admitted only if nothing was preempted; with
scheduler_reserve_full_isl only if the free blocks cover the request's whole sequence on top of
what the running requests still need for theirs, so admitted requests never preempt each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from itertools import chain

from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
from engine_core.kv_connector.scheduling import requeue_settled
from engine_core.kv_offload import KVOffloadManager
from engine_core.kv_offload.scheduling import OffloadScheduling
from engine_core.lora.slots import LoRASlots
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched import update
from engine_core.sched.admission import Admission, full_len
from engine_core.sched.continuum.policy import Continuum
from engine_core.sched.invariants import check_block_pool, check_scheduler_queues
from engine_core.sched.request_queue import create_request_queue
from engine_core.sched.running_pass import RunningPass
from engine_core.sched.step_diff import StepDiff
from engine_core.sched.trace import SchedulerTrace, trace_header
from engine_core.spec_decode.ngram_proposer import NgramProposer
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.messages import (
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
)

RUNNING = RequestStatus.RUNNING


class Scheduler(RunningPass, Admission):
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        eos_token_id: int | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
        offload: KVOffloadManager | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.long_prefill_token_threshold = max(0, config.long_prefill_token_threshold)
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.reserve_full_isl = config.scheduler_reserve_full_isl
        self._full_blocks = 0  # gate: blocks the running requests need at their full length
        self.policy = config.scheduling_policy
        self.eos_token_id = eos_token_id
        # one KV cache group per attention type (sliding-window / hybrid models); None: one
        # full-attention group. A step allocates at most the budget plus drafts per request.
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_hash,
            kv_cache_groups,
            max_chunk=max_num_batched_tokens + config.num_speculative_tokens,
            offload=offload,
        )
        # the KV offload tiers (kv_offload/scheduling.py); None without --kv-offload-memory
        self.kv_offload: OffloadScheduling | None = None
        if offload is not None:
            self.kv_offload = OffloadScheduling(offload, self.kv_cache_manager)
        # disaggregated prefill / decode (kv_connector/); set by the engine core's start-up
        # with the ranks' addresses, None without --kv-transfer-config
        self.kv_connector: KVConnectorScheduler | None = None
        # the continuum policy's pins and job table (continuum/policy.py); None otherwise
        self.continuum: Continuum | None = None
        if self.policy == "continuum":
            self.continuum = Continuum(config, self.kv_cache_manager, clock, offload is not None)
        # the LoRA adapter slots (engine_core/lora/slots.py); None without enable_lora
        self.lora: LoRASlots | None = LoRASlots(config.max_loras) if config.enable_lora else None
        self.waiting = create_request_queue(
            self.policy, self.continuum.program_key if self.continuum is not None else None
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.by_handle: dict[int, Request] = {}  # requests the workers know
        self._next_handle = 0
        self._step_id = 0
        self._finished_handles: list[int] = []  # to tell the workers in the next step
        self._pending_outputs: list[RequestOutput] = []
        self.spec_by_step: dict[int, dict[int, list[int]]] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        # async scheduling: a request whose scheduled tokens reach its end samples a token
        # the scheduler will only see after the next step is planned: count it as an output
        # placeholder, so the gap rule schedules the following position right away
        self.async_scheduling = config.async_scheduling
        self.proposer: NgramProposer | None = None
        if config.speculative_ngram:
            self.proposer = NgramProposer(
                config.speculative_ngram,
                config.num_speculative_tokens,
                config.speculative_ngram_min,
            )
        self.num_draft_tokens = 0  # drafts sent for verification
        self.num_accepted_tokens = 0  # drafts the target model agreed with
        self.num_spec_verifications = 0  # (request, step) pairs that carried drafts
        # the per-step trace (trace.py); every hook sits behind one None test
        self.trace: SchedulerTrace | None = None
        if config.scheduler_trace:
            self.trace = SchedulerTrace(config.scheduler_trace, trace_header(self))
            self.connect_trace()

    def connect_trace(self) -> None:
        """Let the trace record pin events and the clock readings a replay needs."""
        if self.trace is not None and self.continuum is not None:
            self.continuum.events = []
            self.trace.continuum = self.continuum

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if self.continuum is not None:
            self.continuum.tick()
        if request.eos_token_id is None and self.eos_token_id is not None:
            request.set_eos_token_id(self.eos_token_id)
        reason = self._refusal_reason(request)
        if reason is None and self.kv_connector is not None:
            reason = self.kv_connector.on_add(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            request.error = reason
            if self.trace is not None:
                self.trace.on_arrival(request, refused=True)
            self._pending_outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason="error",
                    error=reason,
                )
            )
            return
        request.length_limit = min(request.length_limit, self.max_model_len)
        self.kv_cache_manager.attach_hasher(request)
        self.requests[request.request_id] = request
        if self.continuum is not None:
            self.continuum.on_arrival(request)
        self.waiting.add_request(request)
        if self.trace is not None:
            self.trace.on_arrival(request, refused=False)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish (abort) waiting or running requests; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        assert RequestStatus.is_finished(finished_status), finished_status
        if self.continuum is not None:
            self.continuum.tick()
        if self.trace is not None:
            request_ids = list(request_ids)
            self.trace.on_abort(request_ids, FINISH_REASONS[finished_status])
        from_waiting: list[Request] = []
        from_running: set[int] = set()
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RUNNING:
                from_running.add(id(req))
            else:
                from_waiting.append(req)
            if finished_status != RequestStatus.FINISHED_ABORTED and req.error is None:
                req.error = f"request finished by the engine ({finished_status.name})"
            self.free_request(req, finished_status)
            self._pending_outputs.append(
                RequestOutput(
                    request_id=rid,
                    new_token_ids=[],
                    finish_reason=FINISH_REASONS[finished_status],
                    error=req.error,
                )
            )
        if from_running:
            self.running = [r for r in self.running if id(r) not in from_running]
        if from_waiting:
            self.waiting.remove_requests(from_waiting)

    def free_request(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and release everything; the caller removes it from its queue."""
        if req.status == RUNNING:
            if self.reserve_full_isl:
                self._full_blocks -= self.kv_cache_manager.max_blocks(full_len(req))
            if self.lora is not None and req.lora is not None:
                self.lora.release(req)
        req.status = status
        if self.trace is not None:
            self.trace.on_finish(req, FINISH_REASONS[status])
        if self.continuum is not None:  # may pin the blocks before they are freed
            self.continuum.on_finish(req, status)
        if self.kv_connector is not None:  # may keep the blocks (a lease, a load under way)
            self.kv_connector.request_finished(req, status)
        self.kv_cache_manager.free(req)
        if self.kv_offload is not None:
            self.kv_offload.forget(req.request_id)
        del self.requests[req.request_id]
        if req.handle is not None:  # the workers know it: tell them to forget it
            self._finished_handles.append(req.handle)
            del self.by_handle[req.handle]

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or (with LoRA) a slot operation the ranks must still be sent: an
        unloaded adapter's slot is emptied by a step of its own when nothing else runs; or
        (P/D) connector operations and settled loads that wait for a step."""
        if self.kv_connector is not None and self.kv_connector.has_ops():
            return True
        return (bool(self.running) or bool(self.waiting)
                or (self.lora is not None and bool(self.lora.ops)))

    def has_handles_to_forget(self) -> bool:
        """Finished requests the workers still hold: the next step's diff lists them."""
        return bool(self._finished_handles)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        diff = StepDiff()
        budget = self.max_num_batched_tokens
        if self.continuum is not None:  # before any allocation: expired pins go back
            self.continuum.tick()
            self.continuum.expire()
        if self.kv_connector is not None:  # settled loads rejoin the queue first
            requeue_settled(self.waiting, self.finish_requests, self.kv_connector)
        budget = self._schedule_running(diff, budget)
        if not diff.preempted:
            self._schedule_waiting(diff, budget)
        step_id = self._step_id
        self._step_id += 1
        self.num_steps += 1
        if diff.spec:
            self.spec_by_step[step_id] = diff.spec
        finished, self._finished_handles = self._finished_handles, []
        so = diff.build(step_id, finished, len(self.running), self.kv_cache_manager.num_groups,
                        self.lora.take_ops() if self.lora is not None else None)
        if self.kv_offload is not None:
            # once per step, after every allocation and preemption of it
            so.kv_transfers = self.kv_offload.take_transfers()
        if self.kv_connector is not None:
            so.kv_connector = self.kv_connector.build_connector_meta()
        if self.trace is not None:
            self.trace.on_schedule(self, diff, step_id)
        return so

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append the step's sampled tokens, check stops, free finished requests."""
        if self.continuum is not None:
            self.continuum.tick()
        outputs = update.update_from_output(self, scheduler_output, model_output)
        if self.kv_connector is not None:  # finished prefills say where their KV waits
            self.kv_connector.attach_params(outputs)
        return outputs

    # ------------------------------------------------------------------ introspection

    def get_stats(self) -> dict[str, float]:
        kvm = self.kv_cache_manager
        return {
            "kv_usage": kvm.usage,
            "num_free_blocks": float(kvm.num_free_blocks),
            "prefix_cache_queries": float(kvm.prefix_cache_queries),
            "prefix_cache_hits": float(kvm.prefix_cache_hits),
            "prefix_cache_hit_rate": kvm.prefix_cache_hits / max(1, kvm.prefix_cache_queries),
            "num_running": float(len(self.running)),
            "num_waiting": float(len(self.waiting)),
            "num_preemptions": float(self.num_preemptions),
            "num_steps": float(self.num_steps),
            "spec_num_draft_tokens": float(self.num_draft_tokens),
            "spec_num_accepted_tokens": float(self.num_accepted_tokens),
            "spec_num_verifications": float(self.num_spec_verifications),
            # share of drafts accepted, and tokens gained per verification (bonus included)
            "spec_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
            "spec_mean_accepted_len": 1.0
            + self.num_accepted_tokens / max(1, self.num_spec_verifications),
            **(self.kv_offload.stats() if self.kv_offload is not None else {}),
            **(self.continuum.stats() if self.continuum is not None else {}),
            **(self.kv_connector.stats_dict() if self.kv_connector is not None else {}),
            **(self.lora.stats() if self.lora is not None else {}),
        }

    def close(self) -> None:
        """Finish the trace file (steps still in flight are written without a wall time);
        pins give their blocks back."""
        if self.continuum is not None:
            self.continuum.release_all()
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.trace is not None:
            self.trace.close()
            self.trace = None

    def check_invariants(self) -> None:
        kvm = self.kv_cache_manager
        pins = self.continuum.tables() if self.continuum is not None else ()
        check_block_pool(kvm.block_pool, chain(kvm.held_tables(), pins))
        if self.kv_offload is not None:
            self.kv_offload.offload.check_invariants()
        check_scheduler_queues(
            self.running, self.waiting, kvm.req_to_blocks, self.block_size, self.max_num_seqs,
            self.kv_connector.exempt_ids() if self.kv_connector is not None else (),
        )
        if self.lora is not None:
            self.lora.check(self.running)
        for r in self.running:
            assert self.by_handle.get(r.handle) is r, f"{r} missing from the handle map"  # type: ignore[arg-type]
        held = sum(len(b) for b in kvm.held_tables())
        assert kvm.num_held_blocks == held, (kvm.num_held_blocks, held)
        for m in kvm.managers[1:]:
            for rid, blocks in m.req_to_blocks.items():
                assert len(blocks) == len(kvm.req_to_blocks[rid]), f"{rid}: group tables differ"
        if self.reserve_full_isl:
            full = sum(kvm.max_blocks(full_len(r)) for r in self.running)
            assert self._full_blocks == full, (self._full_blocks, full)
            # (a request too big for the whole cache runs alone: nothing else is admitted)
            if len(self.running) > 1:
                assert full - held <= kvm.num_free_blocks, "admitted requests can run out of KV"
