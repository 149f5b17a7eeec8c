"""The Scheduler: one token budget per step shared by every request (vLLM v1 semantics).

Each request has ``num_computed_tokens`` and ``num_tokens_with_spec``; a step gives each
request part of the gap between them. Decodes (gap 1), prefill chunks (gap = rest of the
prompt), recompute after preemption and speculative drafts are all the same rule.

Applying the model's output (update_from_output) lives in update.py.

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
from engine_core.kv_offload import KVOffloadManager
from engine_core.kv_offload.scheduling import OffloadScheduling
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched import update
from engine_core.sched.continuum.policy import Continuum
from engine_core.sched.invariants import check_block_pool, check_scheduler_queues
from engine_core.sched.request_queue import create_request_queue
from engine_core.sched.step_diff import StepDiff
from engine_core.sched.trace import SchedulerTrace, trace_header
from engine_core.spec_decode.ngram_proposer import NgramProposer
from protocol.codec import pack
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.messages import (
    ModelRunnerOutput,
    NewRequestData,
    RequestOutput,
    ResumedRequestData,
    SchedulerOutput,
)

RUNNING = RequestStatus.RUNNING
LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_NO_BLOCKS: list = []  # never mutated: "allocated nothing new"


def _full_len(req: Request) -> int:
    """KV slots a request holds at the end of its life: every token but the last sampled one
    (it is never fed back), and at least its prompt (a prompt of max_model_len tokens).
    Fixed for the request's life, so the gate can add it on admission and take it back off."""
    n = req.length_limit - 1
    return n if n > req.num_prompt_tokens else req.num_prompt_tokens


class Scheduler:
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
        # the continuum policy's pins and job table (continuum/policy.py); None otherwise
        self.continuum: Continuum | None = None
        if self.policy == "continuum":
            self.continuum = Continuum(config, self.kv_cache_manager, clock, offload is not None)
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
        if self.reserve_full_isl and req.status == RUNNING:
            self._full_blocks -= self.kv_cache_manager.max_blocks(_full_len(req))
        req.status = status
        if self.trace is not None:
            self.trace.on_finish(req, FINISH_REASONS[status])
        if self.continuum is not None:  # may pin the blocks before they are freed
            self.continuum.on_finish(req, status)
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
        return bool(self.running) or bool(self.waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        diff = StepDiff()
        budget = self.max_num_batched_tokens
        if self.continuum is not None:  # before any allocation: expired pins go back
            self.continuum.tick()
            self.continuum.expire()
        budget = self._schedule_running(diff, budget)
        if not diff.preempted:
            self._schedule_waiting(diff, budget)
        step_id = self._step_id
        self._step_id += 1
        self.num_steps += 1
        if diff.spec:
            self.spec_by_step[step_id] = diff.spec
        finished, self._finished_handles = self._finished_handles, []
        so = diff.build(step_id, finished, len(self.running), self.kv_cache_manager.num_groups)
        if self.kv_offload is not None:
            # once per step, after every allocation and preemption of it
            so.kv_transfers = self.kv_offload.take_transfers()
        if self.trace is not None:
            self.trace.on_schedule(self, diff, step_id)
        return so

    def _schedule_running(self, diff: StepDiff, budget: int) -> int:
        running = self.running
        allocate = self.kv_cache_manager.allocate_slots
        threshold = self.long_prefill_token_threshold
        max_model_len = self.max_model_len
        overrides = diff.overrides
        proposer = self.proposer
        async_scheduling = self.async_scheduling
        total = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            if proposer is not None and computed == req.num_tokens - 1:
                # decoding: propose drafts for the positions after the newest token; at most
                # remaining - 1 of them, since a verification also yields one token of its own
                drafts = proposer.propose(req, req.length_limit - req.num_tokens - 1)
                if drafts:
                    req.set_spec_token_ids(drafts)
            placeholders = req.num_output_placeholders
            if placeholders and req.num_tokens + placeholders >= req.length_limit:
                # its last token is already being sampled: nothing more to compute
                assert req.handle is not None
                overrides[req.handle] = 0
                i += 1
                continue
            n = req.num_tokens_with_spec + placeholders - computed
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > max_model_len - computed:  # never compute a position >= max_model_len
                n = max_model_len - computed
            if n <= 0:
                assert req.handle is not None  # running requests always have one
                overrides[req.handle] = 0
                i += 1
                continue
            # drafts are part of n, so their (lookahead) slots are allocated like any token's
            new_blocks = _NO_BLOCKS if computed + n <= req.kv_fast_limit else allocate(req, n)
            while new_blocks is None:
                if self.continuum is not None and self.continuum.relieve(None, strict=False):
                    new_blocks = allocate(req, n)  # a pin went back before anyone is preempted
                    continue
                victim = self._pick_victim()
                vi = running.index(victim)
                given = 0
                if victim is not req and vi < i:  # already scheduled: give its budget back
                    given = diff.forget(victim.handle)  # type: ignore[arg-type]
                    budget += given
                    total -= given
                    i -= 1
                if victim is req and len(running) == 1:
                    # alone and still no room: it can never grow, so it stops here
                    running.pop()
                    self._finish_in_schedule(req, LENGTH_CAPPED, diff)
                    break
                self._preempt(victim, vi, diff, given)
                if victim is req:
                    break
                new_blocks = allocate(req, n)
            if new_blocks is None:  # req itself was preempted or finished: running shrank
                continue
            handle = req.handle
            if new_blocks:
                diff.grown[handle] = new_blocks  # type: ignore[index]
            if n != 1:
                overrides[handle] = n  # type: ignore[index]
            if req.spec_token_ids:
                self._take_spec_tokens(req, n, diff)
            req.num_computed_tokens = computed + n
            if async_scheduling and computed + n >= req.num_tokens + placeholders:
                req.num_output_placeholders = placeholders + 1
            budget -= n
            total += n
            i += 1
        for req in running[i:]:  # out of budget: the rest sit this step out
            overrides[req.handle] = 0  # type: ignore[index]
        diff.total += total
        return budget

    def _take_spec_tokens(self, req: Request, n: int, diff: StepDiff) -> None:
        num_drafts = n - (req.num_tokens - req.num_computed_tokens)
        if num_drafts > 0:
            diff.spec[req.handle] = req.spec_token_ids[:num_drafts]  # type: ignore[index]
        req.set_spec_token_ids([])

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            # worst = largest (priority, arrival_time); the later-admitted one on ties
            return max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
        if self.continuum is not None:
            return max(reversed(self.running), key=self.continuum.victim_key)
        return self.running[-1]

    def _preempt(self, victim: Request, index: int, diff: StepDiff, given_back: int = 0) -> None:
        """Preemption by recompute: free every block, start over (tokens are kept). With the
        KV offload tiers, the computed full blocks (not the ``given_back`` tokens this step
        had scheduled) go to the host tier first, so the restart restores them."""
        del self.running[index]
        written = victim.num_computed_tokens - given_back
        if given_back:  # blocks registered for the tokens given back will hold no KV
            self.kv_cache_manager.uncache_unwritten(victim, written)
        if self.kv_offload is not None:
            self.kv_offload.on_preempt(victim, written)
        self.kv_cache_manager.free(victim)
        if self.reserve_full_isl:
            self._full_blocks -= self.kv_cache_manager.max_blocks(_full_len(victim))
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0
        victim.set_spec_token_ids([])
        victim.num_preemptions += 1
        self.num_preemptions += 1
        diff.preempted.append(victim.handle)  # type: ignore[arg-type]
        self.waiting.prepend_request(victim)

    def _finish_in_schedule(self, req: Request, status: RequestStatus, diff: StepDiff) -> None:
        diff.forget(req.handle)  # type: ignore[arg-type]
        self.free_request(req, status)
        self._pending_outputs.append(
            RequestOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason=FINISH_REASONS[status]
            )
        )

    def _schedule_waiting(self, diff: StepDiff, budget: int) -> None:
        waiting = self.waiting
        running = self.running
        kvm = self.kv_cache_manager
        threshold = self.long_prefill_token_threshold
        chunked = self.enable_chunked_prefill
        gate = self.reserve_full_isl
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting.peek_request()
            hits, num_hit = kvm.get_computed_blocks(req)
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
                    need = (kvm.num_blocks_to_hold(req, _full_len(req), hits)
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
                self._full_blocks += kvm.max_blocks(_full_len(req))
            waiting.pop_request()
            running.append(req)
            req.status = RUNNING
            req.num_computed_tokens = num_hit
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

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append the step's sampled tokens, check stops, free finished requests."""
        if self.continuum is not None:
            self.continuum.tick()
        return update.update_from_output(self, scheduler_output, model_output)

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
        }

    def close(self) -> None:
        """Finish the trace file (steps still in flight are written without a wall time);
        pins give their blocks back."""
        if self.continuum is not None:
            self.continuum.release_all()
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
            self.running, self.waiting, kvm.req_to_blocks, self.block_size, self.max_num_seqs
        )
        for r in self.running:
            assert self.by_handle.get(r.handle) is r, f"{r} missing from the handle map"  # type: ignore[arg-type]
        held = sum(len(b) for b in kvm.held_tables())
        assert kvm.num_held_blocks == held, (kvm.num_held_blocks, held)
        for m in kvm.managers[1:]:
            for rid, blocks in m.req_to_blocks.items():
                assert len(blocks) == len(kvm.req_to_blocks[rid]), f"{rid}: group tables differ"
        if self.reserve_full_isl:
            full = sum(kvm.max_blocks(_full_len(r)) for r in self.running)
            assert self._full_blocks == full, (self._full_blocks, full)
            # (a request too big for the whole cache runs alone: nothing else is admitted)
            if len(self.running) > 1:
                assert full - held <= kvm.num_free_blocks, "admitted requests can run out of KV"
