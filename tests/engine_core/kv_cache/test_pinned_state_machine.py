"""Property test: the block-pool state machine with continuum pins. Finished requests of a job
pin their prefix; pins are claimed by an admission, expire, go back under pressure or at
shutdown, and the accounting (pins count as holders) stays exact after every operation."""

from itertools import chain

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from engine_core.request import Request, RequestStatus
from engine_core.sched.continuum.policy import Continuum, JobState
from engine_core.sched.invariants import check_block_pool
from protocol.config import EngineConfig
from protocol.messages import SamplingParams
from protocol.request_options import JobInfo, RequestOptions
from tests.engine_core.kv_cache.test_block_pool_state_machine import KVCacheMachine

JOBS = ["a", "b", "c"]


class PinnedKVCacheMachine(KVCacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.cont = Continuum(EngineConfig(continuum_ttl=1.0), self.kvm, lambda: self.now,
                              host_tier=False)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), job=st.sampled_from(JOBS), last=st.booleans())
    def finish_turn(self, data: st.DataObject, job: str, last: bool) -> None:
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        r.job_id, r.is_last_step = job, last
        self.cont.jobs.setdefault(job, JobState(0.0))  # the job's first turn arrived
        self.cont.on_finish(r, RequestStatus.FINISHED_STOPPED)
        self.kvm.free(r)

    @rule(job=st.sampled_from(JOBS))
    def claim(self, job: str) -> None:
        # an admission of the job's next turn (its own allocation happened in admit)
        self.cont.on_admitted(Request("x", [1], SamplingParams(), None, 0.0,
                                          RequestOptions(job=JobInfo(job_id=job))), 0)

    @rule(dt=st.floats(0.0, 2.0))
    def expire(self, dt: float) -> None:
        self.now += dt
        self.cont.tick()
        self.cont.expire()
        assert all(p.expires_at > self.now for p in self.cont.pins.pins.values())

    @rule()
    def pressure(self) -> None:
        n = len(self.cont.pins)
        assert self.cont.relieve(None, strict=False) == (n > 0)
        assert len(self.cont.pins) == max(0, n - 1)

    @rule()
    def shutdown(self) -> None:
        self.cont.release_all()
        assert self.cont.pins.num_blocks == 0

    @rule()
    def reset(self) -> None:
        ok = self.kvm.reset_prefix_cache()
        assert ok == (not self.live and not self.cont.pins.pins)

    @invariant()
    def accounting_is_exact(self) -> None:
        kvm = self.kvm
        check_block_pool(kvm.block_pool, chain(kvm.held_tables(), self.cont.tables()))
        assert self.cont.pins.num_blocks == sum(len(t) for t in self.cont.tables())
        held = sum(len(b) for b in kvm.held_tables())
        assert kvm.num_held_blocks == held


TestPinnedKVCacheMachine = PinnedKVCacheMachine.TestCase
TestPinnedKVCacheMachine.settings = settings(max_examples=100, stateful_step_count=30,
                                             deadline=None)
