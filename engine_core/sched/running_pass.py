"""The running pass of a step: each running request gets its share of the token budget, in
admission order; when KV runs out, a victim is preempted by recompute and the pass retries.

A mixin of Scheduler (scheduler.py): the attributes below are the scheduler's own, declared
here so this half reads (and type-checks) on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched.admission import full_len
from engine_core.sched.step_diff import StepDiff
from protocol.messages import RequestOutput

if TYPE_CHECKING:
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.kv_offload.scheduling import OffloadScheduling
    from engine_core.lora.slots import LoRASlots
    from engine_core.sched.continuum.policy import Continuum
    from engine_core.sched.request_queue import WaitingQueue
    from engine_core.spec_decode.ngram_proposer import NgramProposer

RUNNING = RequestStatus.RUNNING
LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_NO_BLOCKS: list = []  # never mutated: "allocated nothing new"


class RunningPass:
    running: list[Request]
    waiting: WaitingQueue
    kv_cache_manager: KVCacheManager
    kv_offload: OffloadScheduling | None
    continuum: Continuum | None
    lora: LoRASlots | None
    proposer: NgramProposer | None
    policy: str
    max_model_len: int
    long_prefill_token_threshold: int
    async_scheduling: bool
    reserve_full_isl: bool
    _full_blocks: int
    num_preemptions: int
    _pending_outputs: list[RequestOutput]

    def free_request(self, req: Request, status: RequestStatus) -> None: ...

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
            self._full_blocks -= self.kv_cache_manager.max_blocks(full_len(victim))
        if self.lora is not None and victim.lora is not None:
            self.lora.release(victim)  # its adapter's slot may go to another while it waits
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
