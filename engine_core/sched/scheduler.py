"""The Scheduler: one token budget per step shared by every request (vLLM v1 semantics).

Each request has ``num_computed_tokens`` and ``num_tokens_with_spec``; a step gives each
request part of the gap between them. Decodes (gap 1), prefill chunks (gap = rest of the
prompt), recompute after preemption and speculative drafts are all the same rule.

The Scheduler composes its parts, each with its state passed in: running_set.py (the running
list and the whole-fit count; the one way in and out of it), running_pass.py (running
requests, preemption), admission.py (waiting requests); applying the model's output
(update_from_output) lives in update.py. Optional features plug in through features.py (hooks
with no-op defaults, and always-present decision objects); plugins.py adapts each feature.

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
from engine_core.kv_offload import KVOffloadManager
from engine_core.kv_offload.scheduling import OffloadScheduling
from engine_core.lora.slots import LoRASlots
from engine_core.multimodal.encoder_cache import EncoderCacheManager
from engine_core.multimodal.scheduling import EncoderScheduling, NoEncoder
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched import update
from engine_core.sched.admission import WaitingAdmission
from engine_core.sched.continuum.policy import Continuum
from engine_core.sched.features import (
    Drafter,
    EncoderPlan,
    Hooks,
    NoDrafts,
    NoPins,
    NoRemoteKV,
    NoRestore,
    NoSlots,
    PinRelief,
    Restorer,
    SchedulerFeature,
    SlotPolicy,
)
from engine_core.sched.invariants import check_block_pool, check_scheduler_queues
from engine_core.sched.plugins import (
    ConnectorFeature,
    ContinuumFeature,
    EncoderFeature,
    LoRASlotFeature,
    NgramDrafter,
    OffloadFeature,
    TraceFeature,
)
from engine_core.sched.request_queue import create_request_queue
from engine_core.sched.running_pass import (
    RunningPass,
    VictimPicker,
    last_admitted,
    lowest_priority,
)
from engine_core.sched.running_set import RunningSet
from engine_core.sched.step_diff import StepDiff
from engine_core.sched.trace import SchedulerTrace, trace_header
from engine_core.spec_decode.ngram_proposer import NgramProposer
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.messages import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)

RUNNING = RequestStatus.RUNNING


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
        images: bool = False,
    ) -> None:
        """images: the model takes images (an encoder budget and cache are kept)."""
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.reserve_full_isl = config.scheduler_reserve_full_isl
        self.policy = config.scheduling_policy
        self.eos_token_id = eos_token_id
        # one KV cache group per attention type (sliding-window / hybrid models); None: one
        # full-attention group. A step allocates at most the budget plus drafts per request.
        kvm = self.kv_cache_manager = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.prefix_hash,
            kv_cache_groups,
            max_chunk=max_num_batched_tokens + config.num_speculative_tokens,
            offload=offload,
        )
        # The features this configuration enables, in hook order (features.py). Each also
        # fills the decision seat it changes; the others keep their null objects.
        self.hooks = Hooks()
        self._offload: OffloadFeature | None = None
        self._continuum: ContinuumFeature | None = None
        self._connector: ConnectorFeature | None = None
        self._lora: LoRASlotFeature | None = None
        self._drafter: NgramDrafter | None = None
        self._trace: TraceFeature | None = None
        self._encoder: EncoderFeature | None = None
        restorer: Restorer = NoRestore()
        pins: PinRelief = NoPins()
        slots: SlotPolicy = NoSlots()
        drafter: Drafter = NoDrafts()
        pick_victim: VictimPicker = last_admitted
        if offload is not None:  # the host / disk tiers (--kv-offload-memory)
            restorer = self._offload = OffloadFeature(OffloadScheduling(offload, kvm))
        program_key = None
        if self.policy == "continuum":  # job pins and program order
            cont = Continuum(config, kvm, clock, offload is not None)
            pins = self._continuum = ContinuumFeature(cont, kvm)
            program_key = cont.program_key
            key = cont.victim_key
            pick_victim = lambda running: max(reversed(running), key=key)  # noqa: E731
        elif self.policy == "priority":
            pick_victim = lowest_priority
        if config.enable_lora:  # the adapter slots (engine_core/lora/slots.py)
            slots = self._lora = LoRASlotFeature(LoRASlots(config.max_loras))
        if config.speculative_ngram:
            drafter = self._drafter = NgramDrafter(NgramProposer(
                config.speculative_ngram,
                config.num_speculative_tokens,
                config.speculative_ngram_min,
            ))
        self.restorer = restorer
        self.waiting = create_request_queue(self.policy, program_key)
        self.running_set = RunningSet(kvm, slots, pins, self.reserve_full_isl)
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.by_handle: dict[int, Request] = {}  # requests the workers know
        self.images = images
        encoder: EncoderPlan = NoEncoder()
        if images:  # the encoder budget per step and the encoder cache (multimodal/)
            enc_budget = config.max_num_encoder_input_tokens or max_num_batched_tokens
            encoder = self._encoder = EncoderFeature(
                EncoderScheduling(EncoderCacheManager(config.encoder_cache_size or enc_budget),
                                  enc_budget),
                self.requests, self.by_handle)
        self._admission = WaitingAdmission(
            config, self.waiting, self.running_set, kvm, self.by_handle, max_model_len,
            max_num_batched_tokens, slots, restorer, pins, self.hooks, encoder)
        self._running_pass = RunningPass(
            config, self.running_set, self.waiting, kvm, max_model_len, drafter, pins,
            pick_victim, self.hooks, self._finish_in_schedule, encoder)
        self.slots = slots
        self._step_id = 0
        self._finished_handles: list[int] = []  # to tell the workers in the next step
        self._pending_outputs: list[EngineCoreOutput] = []
        self.spec_by_step: dict[int, dict[int, list[int]]] = {}
        self.num_steps = 0
        self.num_draft_tokens = 0  # drafts sent for verification
        self.num_accepted_tokens = 0  # drafts the target model agreed with
        self.num_spec_verifications = 0  # (request, step) pairs that carried drafts
        self._set_features()
        if config.scheduler_trace:  # the per-step trace (trace.py)
            self.trace = SchedulerTrace(config.scheduler_trace, trace_header(self))
            self.connect_trace()

    def _set_features(self) -> None:
        features: list[SchedulerFeature | None] = [
            self._offload, self._continuum, self._connector, self._lora, self._drafter,
            self._encoder, self._trace]
        self.hooks.set(f for f in features if f is not None)

    # ------------------------------------------------------------------ the features' objects
    # (None when the feature is off: the engine core, the census, scripts and tests ask)

    @property
    def kv_offload(self) -> OffloadScheduling | None:
        return self._offload.scheduling if self._offload is not None else None

    @property
    def continuum(self) -> Continuum | None:
        return self._continuum.continuum if self._continuum is not None else None

    @property
    def lora(self) -> LoRASlots | None:
        return self._lora.slots if self._lora is not None else None

    @property
    def encoder(self) -> EncoderScheduling | None:
        return self._encoder.scheduling if self._encoder is not None else None

    @property
    def proposer(self) -> NgramProposer | None:
        return self._drafter.proposer if self._drafter is not None else None

    @property
    def kv_connector(self) -> KVConnectorScheduler | None:
        """Disaggregated prefill / decode (kv_connector/); set by the engine core's start-up
        with the ranks' addresses, None without --kv-transfer-config."""
        return self._connector.conn if self._connector is not None else None

    @kv_connector.setter
    def kv_connector(self, conn: KVConnectorScheduler | None) -> None:
        self._connector = None
        self._admission.remote = NoRemoteKV()
        if conn is not None:
            self._connector = ConnectorFeature(conn, self.waiting, self.finish_requests)
            self._admission.remote = self._connector
        self._set_features()

    @property
    def trace(self) -> SchedulerTrace | None:
        return self._trace.trace if self._trace is not None else None

    @trace.setter
    def trace(self, trace: SchedulerTrace | None) -> None:
        self._trace = TraceFeature(trace, self) if trace is not None else None
        self._set_features()

    @property
    def running(self) -> list[Request]:
        """The running requests in admission order (owned by the running set: read it, or
        replace its contents as a whole)."""
        return self.running_set.requests

    @running.setter
    def running(self, requests: list[Request]) -> None:
        self.running_set.requests[:] = requests

    @property
    def num_preemptions(self) -> int:
        return self._running_pass.num_preemptions

    def connect_trace(self) -> None:
        """Let the trace record pin events and the clock readings a replay needs."""
        trace, cont = self.trace, self.continuum
        if trace is not None and cont is not None:
            cont.events = []
            trace.continuum = cont

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        hooks = self.hooks
        for tick in hooks.tick:
            tick()
        if request.eos_token_id is None and self.eos_token_id is not None:
            request.set_eos_token_id(self.eos_token_id)
        reason = self._admission.refusal_reason(request)
        if request.mm_items and not self.images:
            reason = reason or "this model does not accept images"
        for refuse in hooks.refuse:
            reason = reason or refuse(request)
        if reason:
            request.status = RequestStatus.FINISHED_IGNORED
            request.error = reason
            for on_arrival in hooks.on_arrival:
                on_arrival(request, True)
            self._pending_outputs.append(
                EngineCoreOutput(
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
        # before it is queued: continuum orders the queue by the job's program
        for on_arrival in hooks.on_arrival:
            on_arrival(request, False)
        self.waiting.add_request(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """Finish (abort) waiting or running requests; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        assert RequestStatus.is_finished(finished_status), finished_status
        hooks = self.hooks
        for tick in hooks.tick:
            tick()
        request_ids = list(request_ids)
        for on_abort in hooks.on_abort:
            on_abort(request_ids, FINISH_REASONS[finished_status])
        from_waiting: list[Request] = []
        from_running = False
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RUNNING:
                from_running = True
            else:
                from_waiting.append(req)
            if finished_status != RequestStatus.FINISHED_ABORTED and req.error is None:
                req.error = f"request finished by the engine ({finished_status.name})"
            self.free_request(req, finished_status)
            self._pending_outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=[],
                    finish_reason=FINISH_REASONS[finished_status],
                    error=req.error,
                )
            )
        if from_running:
            self.running_set.prune()
        if from_waiting:
            self.waiting.remove_requests(from_waiting)

    def free_request(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and release everything; the caller removes it from its queue (a
        running request: ``RunningSet.prune``)."""
        if req.status == RUNNING:
            self.running_set.leave(req)
        req.status = status
        hooks = self.hooks
        for on_finish in hooks.on_finish:  # may keep the blocks (a pin, a lease)
            on_finish(req, status)
        self.kv_cache_manager.free(req)
        for after_free in hooks.after_free:
            after_free(req)
        del self.requests[req.request_id]
        if req.handle is not None:  # the workers know it: tell them to forget it
            self._finished_handles.append(req.handle)
            del self.by_handle[req.handle]

    def take_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or an operation the ranks must still be sent: (LoRA) an unloaded
        adapter's slot is emptied by a step of its own when nothing else runs; (P/D)
        connector operations and settled loads that wait for a step."""
        if self.running_set.requests or self.waiting:
            return True
        return any(has_work() for has_work in self.hooks.has_work)

    def has_handles_to_forget(self) -> bool:
        """Finished requests the workers still hold: the next step's diff lists them."""
        return bool(self._finished_handles)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        hooks = self.hooks
        for tick in hooks.tick:
            tick()
        for begin_step in hooks.begin_step:  # expired pins go back, settled loads rejoin
            begin_step()
        diff = StepDiff()
        budget = self._running_pass.schedule(diff, self.max_num_batched_tokens)
        if not diff.preempted:
            self._admission.schedule(diff, budget)
        step_id = self._step_id
        self._step_id += 1
        self.num_steps += 1
        if diff.spec:
            self.spec_by_step[step_id] = diff.spec
        finished, self._finished_handles = self._finished_handles, []
        for before_build in hooks.before_build:
            before_build(diff)
        so = diff.build(step_id, finished, len(self.running_set.requests),
                        self.kv_cache_manager.num_groups, self.slots.take_ops())
        for on_step_built in hooks.on_step_built:
            on_step_built(so, diff, step_id)
        return so

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append the step's sampled tokens, check stops, free finished requests."""
        hooks = self.hooks
        for tick in hooks.tick:
            tick()
        kv_load = self.restorer.absorb(model_output)
        for on_model_output in hooks.on_model_output:
            on_model_output(model_output)
        outputs = update.update_from_output(self, scheduler_output, model_output)
        step_id = scheduler_output.step_id
        for after_update in hooks.after_update:
            after_update(step_id, outputs, kv_load)
        return outputs

    def _finish_in_schedule(self, req: Request, status: RequestStatus, diff: StepDiff) -> None:
        """A running request ends while its step is planned (it can never grow)."""
        assert req.handle is not None  # it is running
        diff.forget(req.handle)
        self.free_request(req, status)
        self.running_set.prune()
        self._pending_outputs.append(
            EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason=FINISH_REASONS[status]
            )
        )

    def _pick_victim(self) -> Request:
        return self._running_pass.pick_victim(self.running_set.requests)

    # ------------------------------------------------------------------ introspection

    def get_stats(self) -> dict[str, float]:
        kvm = self.kv_cache_manager
        stats = {
            "kv_usage": kvm.usage,
            "num_free_blocks": float(kvm.num_free_blocks),
            "prefix_cache_queries": float(kvm.prefix_cache_queries),
            "prefix_cache_hits": float(kvm.prefix_cache_hits),
            "prefix_cache_hit_rate": kvm.prefix_cache_hits / max(1, kvm.prefix_cache_queries),
            "num_running": float(len(self.running_set.requests)),
            "num_waiting": float(len(self.waiting)),
            "num_preemptions": float(self.num_preemptions),
            "num_steps": float(self.num_steps),
            # finished requests the ranks are still to be told of (by the next step)
            "num_handles_to_forget": float(len(self._finished_handles)),
            "spec_num_draft_tokens": float(self.num_draft_tokens),
            "spec_num_accepted_tokens": float(self.num_accepted_tokens),
            "spec_num_verifications": float(self.num_spec_verifications),
            # share of drafts accepted, and tokens gained per verification (bonus included)
            "spec_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
            "spec_mean_accepted_len": 1.0
            + self.num_accepted_tokens / max(1, self.num_spec_verifications),
        }
        for feature_stats in self.hooks.stats:
            stats.update(feature_stats())
        return stats

    def close(self) -> None:
        """Finish the trace file (steps still in flight are written without a wall time);
        pins give their blocks back."""
        for close in self.hooks.close:
            close()
        self.trace = None

    def check_invariants(self) -> None:
        kvm = self.kv_cache_manager
        hooks = self.hooks
        running = self.running_set.requests
        held_elsewhere = chain.from_iterable(tables() for tables in hooks.held_tables)
        check_block_pool(kvm.block_pool, chain(kvm.held_tables(), held_elsewhere))
        exempt = set(chain.from_iterable(ids() for ids in hooks.exempt_ids))
        check_scheduler_queues(
            running, self.waiting, kvm.req_to_blocks, self.block_size, self.max_num_seqs, exempt)
        for check in hooks.check:
            check(running)
        for r in running:
            assert r.handle is not None and self.by_handle.get(r.handle) is r, (
                f"{r} missing from the handle map")
        held = sum(len(b) for b in kvm.held_tables())
        assert kvm.num_held_blocks == held, (kvm.num_held_blocks, held)
        for m in kvm.managers[1:]:
            for rid, blocks in m.req_to_blocks.items():
                assert len(blocks) == len(kvm.req_to_blocks[rid]), f"{rid}: group tables differ"
        self.running_set.check()
