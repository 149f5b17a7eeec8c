"""The running pass of a step: each running request gets its share of the token budget, in
admission order; when KV runs out, a victim is preempted by recompute and the pass retries.

Features act through objects that are always present (features.py): the drafter proposes
drafts for decoding requests, the encoder plan cuts a chunk before an image that cannot be
encoded this step, the pin relief gives a pin back before anyone is preempted, and
the hooks hear of each preemption (the offload tier copies the victim's blocks out).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine_core.request import Request, RequestStatus
from engine_core.sched.running_set import handle_of
from engine_core.sched.step_diff import StepDiff

if TYPE_CHECKING:
    from engine_core.kv_cache.manager import KVCacheManager
    from engine_core.sched.features import Drafter, EncoderPlan, Hooks, PinRelief
    from engine_core.sched.request_queue import WaitingQueue
    from engine_core.sched.running_set import RunningSet
    from protocol.config import EngineConfig

LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_NO_BLOCKS: list = []  # never mutated: "allocated nothing new"

# picks the request to preempt from the running set (never empty)
VictimPicker = Callable[[list[Request]], Request]


def last_admitted(running: list[Request]) -> Request:
    return running[-1]


def lowest_priority(running: list[Request]) -> Request:
    # worst = largest (priority, arrival_time); the later-admitted one on ties
    return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))


class RunningPass:
    def __init__(
        self,
        config: EngineConfig,
        running: RunningSet,
        waiting: WaitingQueue,
        kvm: KVCacheManager,
        max_model_len: int,
        drafter: Drafter,
        pins: PinRelief,
        pick_victim: VictimPicker,
        hooks: Hooks,
        finish_in_schedule: Callable[[Request, RequestStatus, StepDiff], None],
        encoder: EncoderPlan,
    ) -> None:
        self.running = running
        self.waiting = waiting
        self.kvm = kvm
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = max(0, config.long_prefill_token_threshold)
        # async scheduling: a request whose scheduled tokens reach its end samples a token
        # the scheduler will only see after the next step is planned: count it as an output
        # placeholder, so the gap rule schedules the following position right away
        self.async_scheduling = config.async_scheduling
        self.drafter = drafter
        self.pins = pins
        self.pick_victim = pick_victim
        self.hooks = hooks
        self.finish_in_schedule = finish_in_schedule
        self.encoder = encoder
        self.num_preemptions = 0

    def schedule(self, diff: StepDiff, budget: int) -> int:
        """Give the running requests their tokens; returns the budget left."""
        running = self.running.requests
        allocate = self.kvm.allocate_slots
        threshold = self.long_prefill_token_threshold
        max_model_len = self.max_model_len
        overrides = diff.overrides
        draft = self.drafter.draft
        drafting = self.drafter.proposes
        relieve = self.pins.relieve
        async_scheduling = self.async_scheduling
        encoding = self.encoder.encodes
        plan_images = self.encoder.plan
        total = 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            handle = req.handle
            assert handle is not None  # given on its first admission, kept until it ends
            if drafting and computed == req.num_tokens - 1:
                draft(req)  # decoding: drafts for the positions after the newest token
            placeholders = req.num_output_placeholders
            if placeholders and req.num_tokens + placeholders >= req.length_limit:
                # its last token is already being sampled: nothing more to compute
                overrides[handle] = 0
                i += 1
                continue
            n = req.num_tokens_with_spec + placeholders - computed
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > max_model_len - computed:  # never compute a position >= max_model_len
                n = max_model_len - computed
            images = None
            if encoding and computed < req.mm_end:  # the chunk may cross an image
                n, images = plan_images(req, computed, n)
            if n <= 0:
                overrides[handle] = 0
                i += 1
                continue
            # drafts are part of n, so their (lookahead) slots are allocated like any token's
            new_blocks = _NO_BLOCKS if computed + n <= req.kv_fast_limit else allocate(req, n)
            while new_blocks is None:
                if relieve(None, strict=False):
                    new_blocks = allocate(req, n)  # a pin went back before anyone is preempted
                    continue
                victim = self.pick_victim(running)
                vi = running.index(victim)
                given = 0
                if victim is not req and vi < i:  # already scheduled: give its budget back
                    given = diff.forget(handle_of(victim))
                    budget += given
                    total -= given
                    i -= 1
                if victim is req and len(running) == 1:
                    # alone and still no room: it can never grow, so it stops here
                    self.finish_in_schedule(req, LENGTH_CAPPED, diff)
                    break
                self.preempt(vi, diff, given)
                if victim is req:
                    break
                new_blocks = allocate(req, n)
            if new_blocks is None:  # req itself was preempted or finished: running shrank
                continue
            if new_blocks:
                diff.grown[handle] = new_blocks
            if images:
                self.encoder.commit(req, images)
            if n != 1:
                overrides[handle] = n
            if req.spec_token_ids:
                self._take_spec_tokens(req, handle, n, diff)
            req.num_computed_tokens = computed + n
            if async_scheduling and computed + n >= req.num_tokens + placeholders:
                req.num_output_placeholders = placeholders + 1
            budget -= n
            total += n
            i += 1
        for req in running[i:]:  # out of budget: the rest sit this step out
            overrides[handle_of(req)] = 0
        diff.total += total
        return budget

    def _take_spec_tokens(self, req: Request, handle: int, n: int, diff: StepDiff) -> None:
        num_drafts = n - (req.num_tokens - req.num_computed_tokens)
        if num_drafts > 0:
            diff.spec[handle] = req.spec_token_ids[:num_drafts]
        req.set_spec_token_ids([])

    def preempt(self, index: int, diff: StepDiff, given_back: int = 0) -> None:
        """Preemption by recompute: free every block, start over (tokens are kept). The
        hooks hear of it first, with the computed tokens (not the ``given_back`` tokens this
        step had scheduled): the KV offload tiers copy those full blocks out, so the restart
        restores them."""
        kvm = self.kvm
        victim = self.running.requests[index]
        written = victim.num_computed_tokens - given_back
        if given_back:  # blocks registered for the tokens given back will hold no KV
            kvm.uncache_unwritten(victim, written)
        for hook in self.hooks.on_preempt:
            hook(victim, written)
        kvm.free(victim)
        self.running.remove_at(index)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0
        victim.set_spec_token_ids([])
        victim.num_preemptions += 1
        self.num_preemptions += 1
        diff.preempted.append(handle_of(victim))
        self.waiting.prepend_request(victim)
