"""A pure-Python model of what one worker holds, driven only by the wire diffs.

It follows the rules in protocol/messages.py literally, so a property test can check that the
diffs a real Scheduler emits are enough to reconstruct its view on the worker side. Anything a
real worker would refuse to compute on (a step gap, an unknown handle, a count mismatch)
raises WorkerStateError.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.codec import pack, unpack
from protocol.messages import ModelRunnerOutput, SchedulerOutput


class WorkerStateError(AssertionError):
    pass


@dataclass
class ReqState:
    tokens: list[int]  # prompt + every token sampled so far (the worker's own samples)
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class WorkerModel:
    reqs: dict[int, ReqState] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)  # insertion order, like a persistent batch
    next_step_id: int = 0
    # handle -> tokens scheduled in the step being executed
    scheduled: dict[int, int] = field(default_factory=dict)

    def apply(self, so: SchedulerOutput) -> dict[int, int]:
        """Apply one step plan; return {handle: num_scheduled_tokens} for this step."""
        if so.step_id != self.next_step_id:
            raise WorkerStateError(f"step gap: expected {self.next_step_id}, got {so.step_id}")
        self.next_step_id += 1
        running = set(self.running)
        for h in unpack(so.finished_handles):
            if h not in self.reqs:
                raise WorkerStateError(f"finished unknown handle {h}")
            del self.reqs[h]
            running.discard(h)
        for h in unpack(so.preempted_handles):
            if h not in running:
                raise WorkerStateError(f"preempted handle {h} is not running")
            running.discard(h)
            self.reqs[h].block_ids = []
        own: dict[int, int] = {}  # new and resumed requests carry their own counts
        for nr in so.new_reqs:
            if nr.handle in self.reqs:
                raise WorkerStateError(f"new request reuses live handle {nr.handle}")
            self.reqs[nr.handle] = ReqState(
                unpack(nr.prompt_token_ids), unpack(nr.block_ids), nr.num_computed_tokens
            )
            running.add(nr.handle)
            own[nr.handle] = nr.num_scheduled_tokens
        for rr in so.resumed_reqs:
            st = self.reqs.get(rr.handle)
            if st is None or rr.handle in running:
                raise WorkerStateError(f"resumed handle {rr.handle} is unknown or running")
            st.block_ids = unpack(rr.block_ids)
            st.num_computed_tokens = rr.num_computed_tokens
            running.add(rr.handle)
            own[rr.handle] = rr.num_scheduled_tokens
        cr = so.cached_reqs
        flat = unpack(cr.new_block_ids)
        pos = 0
        for h, n in zip(unpack(cr.handles), unpack(cr.new_block_counts), strict=True):
            if h not in running:
                raise WorkerStateError(f"new blocks for handle {h} that is not running")
            self.reqs[h].block_ids.extend(flat[pos : pos + n])
            pos += n
        if pos != len(flat):
            raise WorkerStateError("cached_reqs block ids do not match their counts")
        # keep the old order, then append arrivals: order is irrelevant to the checks
        self.running = [h for h in self.running if h in running]
        self.running += [h for h in running if h not in set(self.running)]
        sched = {h: 1 for h in self.running}
        sched.update(own)
        for h, n in zip(
            unpack(so.sched_override_handles), unpack(so.sched_override_counts), strict=True
        ):
            if h not in running:
                raise WorkerStateError(f"override for handle {h} that is not running")
            sched[h] = n
        sched = {h: n for h, n in sched.items() if n > 0}
        if so.num_running != len(self.running):
            raise WorkerStateError(f"num_running {so.num_running} != {len(self.running)}")
        if so.total_num_scheduled_tokens != sum(sched.values()):
            raise WorkerStateError(
                f"total {so.total_num_scheduled_tokens} != {sum(sched.values())} scheduled"
            )
        for h, n in sched.items():
            st = self.reqs[h]
            if st.num_computed_tokens + n > len(st.tokens):
                raise WorkerStateError(f"handle {h}: scheduled past its known tokens")
        self.scheduled = sched
        return sched

    def execute(self, step_id: int, sample: dict[int, int]) -> ModelRunnerOutput:
        """Run the step: advance num_computed_tokens; requests whose computation reached
        their last known token sample one (``sample[handle]``, chosen by the caller)."""
        handles, tokens = [], []
        for h, n in self.scheduled.items():
            st = self.reqs[h]
            st.num_computed_tokens += n
            if st.num_computed_tokens == len(st.tokens):  # not a partial prefill chunk
                tok = sample[h]
                st.tokens.append(tok)
                handles.append(h)
                tokens.append(tok)
        return ModelRunnerOutput(
            step_id=step_id, rank=0, req_handles=pack(handles), sampled_token_ids=pack(tokens)
        )
