"""The scheduler's features, plugged in through the seams of features.py.

Each class adapts one feature's own object (kept where it lives: lora/slots.py,
kv_offload/scheduling.py, kv_connector/scheduler_side.py, sched/continuum/policy.py,
spec_decode/ngram_proposer.py, sched/trace.py) to the hooks and decision protocols; the
Scheduler builds the ones its configuration enables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from engine_core.kv_connector.scheduling import requeue_settled
from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched.features import SchedulerFeature

if TYPE_CHECKING:
    from engine_core.kv_cache.block import KVCacheBlock
    from engine_core.kv_cache.coordinator import KVCacheBlocks
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.kv_cache.single_type_manager import TableKey
    from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
    from engine_core.kv_offload.scheduling import OffloadScheduling
    from engine_core.lora.slots import LoRASlots
    from engine_core.multimodal.scheduling import EncoderScheduling
    from engine_core.sched.continuum.policy import Continuum
    from engine_core.sched.interface import SchedulerView
    from engine_core.sched.request_queue import WaitingQueue
    from engine_core.sched.step_diff import StepDiff
    from engine_core.sched.trace import SchedulerTrace
    from engine_core.spec_decode.ngram_proposer import NgramProposer
    from protocol.lora import LoRASlotOp
    from protocol.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput


class LoRASlotFeature(SchedulerFeature):
    """The adapter slots: the per-pass adapter budget decides admission; a request pins its
    adapter's slot while it runs."""

    def __init__(self, slots: LoRASlots) -> None:
        self.slots = slots

    # the slot policy (features.SlotPolicy); base-model requests hold no slot
    def begin_pass(self) -> None:
        self.slots.begin_pass()

    def skip(self, req: Request) -> bool:
        return req.lora is not None and self.slots.skip(req)

    def acquire(self, req: Request) -> None:
        if req.lora is not None:
            self.slots.acquire(req)  # a slot load, if any, goes in this step's diff

    def release(self, req: Request) -> None:
        if req.lora is not None:
            self.slots.release(req)  # its slot may go to another adapter while it waits

    def take_ops(self) -> list[LoRASlotOp] | None:
        return self.slots.take_ops()

    # hooks
    def has_work(self) -> bool:
        # an unloaded adapter's slot is emptied by a step of its own when nothing else runs
        return bool(self.slots.ops)

    def stats(self) -> dict[str, float]:
        return self.slots.stats()

    def check(self, running: list[Request]) -> None:
        self.slots.check(running)


class OffloadFeature(SchedulerFeature):
    """The host / disk KV tiers: preempted requests' blocks are copied out, admissions
    restore what follows their device prefix hit."""

    def __init__(self, scheduling: OffloadScheduling) -> None:
        self.scheduling = scheduling

    # the restorer (features.Restorer)
    def blocks_to_restore(self, req: Request, num_hit_tokens: int) -> int | None:
        return self.scheduling.blocks_to_restore(req, num_hit_tokens)

    def on_restored(self, num_restored_blocks: int) -> None:
        if num_restored_blocks:
            self.scheduling.on_admitted(num_restored_blocks)

    def absorb(self, model_output: ModelRunnerOutput) -> list[list[int]] | None:
        if model_output.kv_copy_us:
            self.scheduling.copy_seconds += model_output.kv_copy_us * 1e-6
        if model_output.kv_load is None:
            return None
        # disk -> host reads every rank finished (or one failed): restorable (or dropped)
        return self.scheduling.complete_loads(model_output.kv_load)

    # hooks
    def on_preempt(self, req: Request, num_written_tokens: int) -> None:
        self.scheduling.on_preempt(req, num_written_tokens)

    def after_free(self, req: Request) -> None:
        self.scheduling.forget(req.request_id)

    def on_step_built(self, so: SchedulerOutput, diff: StepDiff, step_id: int) -> None:
        # once per step, after every allocation and preemption of it
        so.kv_transfers = self.scheduling.take_transfers()

    def stats(self) -> dict[str, float]:
        return self.scheduling.stats()

    def check(self, running: list[Request]) -> None:
        self.scheduling.offload.check_invariants()


class ContinuumFeature(SchedulerFeature):
    """Continuum's job pins: a finished turn's KV stays pinned until the job's next turn or
    the pin's TTL; pins go back under memory pressure before anyone is preempted."""

    def __init__(self, continuum: Continuum, kvm: KVCacheManager) -> None:
        self.continuum = continuum
        self.kvm = kvm

    # pin relief (features.PinRelief)
    def relieve(self, for_req: Request | None, strict: bool) -> bool:
        return self.continuum.relieve(for_req, strict)

    def blocks_to_fit(self, req: Request, hits: KVCacheBlocks, running: bool) -> int:
        if not running or not len(self.continuum.pins):
            return 0
        # program-level FCFS over memory: admitted chunk by chunk, the prompt would take its
        # later chunks' blocks from earlier jobs' pins (a running request's growth releases
        # any pin before it preempts), so it waits until the whole prompt fits beside them
        return self.kvm.num_blocks_to_hold(req, req.num_tokens + 1, hits)

    def victim_key(self, req: Request) -> tuple[bool, float]:
        return self.continuum.victim_key(req)

    # hooks
    def tick(self) -> None:
        self.continuum.tick()

    def on_arrival(self, req: Request, refused: bool) -> None:
        if not refused:
            self.continuum.on_arrival(req)

    def begin_step(self) -> None:
        self.continuum.expire()  # before any allocation: expired pins go back

    def on_admitted(self, req: Request, num_hit_tokens: int) -> None:
        self.continuum.on_admitted(req, num_hit_tokens)

    def on_finish(self, req: Request, status: RequestStatus) -> None:
        self.continuum.on_finish(req, status)  # may pin the blocks before they are freed

    def stats(self) -> dict[str, float]:
        return self.continuum.stats()

    def held_tables(self) -> Iterable[list[KVCacheBlock]]:
        return self.continuum.tables()

    def close(self) -> None:
        self.continuum.release_all()


class ConnectorFeature(SchedulerFeature):
    """The KV connector's scheduler side (P/D): a decode request's prompt KV loads from the
    prefill engine while it is set aside; a finished prefill's blocks stay leased."""

    def __init__(self, conn: KVConnectorScheduler, waiting: WaitingQueue,
                 finish: Callable[[Iterable[str], RequestStatus], None]) -> None:
        self.conn = conn
        self.waiting = waiting
        self.finish = finish

    # remote KV (features.RemoteKV)
    def loads_async(self, req: Request, num_hit_tokens: int) -> int:
        if req.kv_transfer_params is None:
            return 0
        num_ext, load_async = self.conn.get_num_new_matched_tokens(req, num_hit_tokens)
        return num_ext if load_async else 0

    def on_set_aside(self, req: Request, num_hit_tokens: int, num_external: int) -> None:
        self.conn.update_state_after_alloc(req, num_hit_tokens, num_external)

    # hooks
    def refuse(self, req: Request) -> str | None:
        return self.conn.on_add(req)

    def begin_step(self) -> None:
        requeue_settled(self.waiting, self.finish, self.conn)  # settled loads rejoin first

    def on_finish(self, req: Request, status: RequestStatus) -> None:
        self.conn.request_finished(req, status)  # may keep the blocks (a lease, a load)

    def on_step_built(self, so: SchedulerOutput, diff: StepDiff, step_id: int) -> None:
        so.kv_connector = self.conn.build_connector_meta()

    def after_update(self, step_id: int, outputs: list[EngineCoreOutput],
                     kv_load: list[list[int]] | None) -> None:
        self.conn.attach_params(outputs)  # finished prefills say where their KV waits

    def has_work(self) -> bool:
        return self.conn.has_ops()

    def stats(self) -> dict[str, float]:
        return self.conn.stats_dict()

    def exempt_ids(self) -> Iterable[TableKey]:
        return self.conn.exempt_ids()

    def close(self) -> None:
        self.conn.close()


class EncoderFeature(SchedulerFeature):
    """Images: the encoder budget per step and the encoder-output cache
    (engine_core/multimodal/); the passes ask its plan, the hooks give references back."""

    encodes = True

    def __init__(self, scheduling: EncoderScheduling, requests: dict[str, Request],
                 by_handle: dict[int, Request]) -> None:
        self.scheduling = scheduling
        self.requests = requests
        self.by_handle = by_handle

    # the encoder plan (features.EncoderPlan)
    def plan(self, req: Request, computed: int, n: int) -> tuple[int, list[int]]:
        return self.scheduling.plan(req, computed, n)

    def commit(self, req: Request, needed: list[int]) -> None:
        self.scheduling.commit(req, needed)

    # hooks

    def refuse(self, req: Request) -> str | None:
        return self.scheduling.refuse(req) if req.mm_items else None

    def begin_step(self) -> None:
        self.scheduling.begin_step()

    def on_preempt(self, req: Request, num_written_tokens: int) -> None:
        self.scheduling.release_all(req)

    def after_free(self, req: Request) -> None:
        self.scheduling.release_all(req)

    def before_build(self, diff: StepDiff) -> None:
        diff.encoder = self.scheduling.take_step(diff, self.by_handle)

    def on_model_output(self, model_output: ModelRunnerOutput) -> None:
        self.scheduling.encoder_seconds += model_output.encoder_us * 1e-6

    def after_update(self, step_id: int, outputs: list[EngineCoreOutput],
                     kv_load: list[list[int]] | None) -> None:
        self.scheduling.release_computed(self.requests)

    def stats(self) -> dict[str, float]:
        return self.scheduling.stats()

    def check(self, running: list[Request]) -> None:
        self.scheduling.check(running)


class NgramDrafter(SchedulerFeature):
    """N-gram drafts for decoding requests (verified by the target model in the step)."""

    proposes = True

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer

    def draft(self, req: Request) -> None:
        # at most remaining - 1 drafts, since a verification also yields one token of its own
        drafts = self.proposer.propose(req, req.length_limit - req.num_tokens - 1)
        if drafts:
            req.set_spec_token_ids(drafts)


class TraceFeature(SchedulerFeature):
    """The per-step scheduler trace (trace.py): arrivals, aborts, finishes and each step's
    decisions, for replay."""

    def __init__(self, trace: SchedulerTrace, sched: SchedulerView) -> None:
        self.trace = trace
        self.sched = sched

    def on_arrival(self, req: Request, refused: bool) -> None:
        self.trace.on_arrival(req, refused)

    def on_abort(self, request_ids: list[str], reason: str) -> None:
        self.trace.on_abort(request_ids, reason)

    def on_finish(self, req: Request, status: RequestStatus) -> None:
        self.trace.on_finish(req, FINISH_REASONS[status])

    def on_step_built(self, so: SchedulerOutput, diff: StepDiff, step_id: int) -> None:
        self.trace.on_schedule(self.sched, diff, step_id)

    def after_update(self, step_id: int, outputs: list[EngineCoreOutput],
                     kv_load: list[list[int]] | None) -> None:
        self.trace.on_update(step_id, kv_load)

    def close(self) -> None:
        self.trace.close()
