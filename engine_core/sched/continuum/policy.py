"""The continuum policy's state and the scheduler's hooks into it.

A job is the agent program a request belongs to (Request.job_id). The scheduler calls in at
five points, each behind one None test: a request arrives (the gap since the job's last turn
is observed), a request finishes (its blocks are pinned for a TTL unless it was the job's last
step), a request is admitted (its job's pin is claimed: the prefix hit now holds the blocks),
the top of schedule() (expired pins are released before anything is allocated) and an
allocation that would fail (pins are released, the latest expected return first).

Time comes from an injected clock read once per scheduler entry (tick), so tests control it
and a trace replay feeds the recorded readings back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from engine_core.sched.continuum.pins import RETURNED, Pin, PinTable
from engine_core.sched.continuum.ttl import HOST_RESTORE_COST_RATIO, GapModel
from protocol.config import EngineConfig

MAX_JOBS = 65536  # jobs remembered; a client that never sends a last step cannot grow this


@dataclass(slots=True)
class JobState:
    first_arrival: float  # program-level FCFS orders the job's turns by this
    last_finish: float | None = None  # clock of its latest finished turn, until the next arrives
    last_tool: str | None = None  # the tool hint of that turn


class Continuum:
    def __init__(self, config: EngineConfig, kvm: KVCacheManager,
                 clock: Callable[[], float], host_tier: bool) -> None:
        self.kvm = kvm
        self.clock = clock
        self.now = clock()
        self.gaps = GapModel(config.continuum_max_ttl, config.continuum_ttl)
        self.pins = PinTable(kvm.block_pool)
        self.jobs: dict[str, JobState] = {}
        # losing a pin costs a restore instead of a prefill when the host tier takes the
        # evicted blocks
        self.loss_ratio = HOST_RESTORE_COST_RATIO if host_tier else 1.0
        # what happened to pins since the trace last took them: [event, job, blocks, detail]
        self.events: list[list[Any]] | None = None
        self.num_pins = 0
        self.num_skipped = 0  # finished turns the TTL rule chose not to pin
        self.num_claims = 0
        self.num_expiries = 0
        self.num_pressure_releases = 0
        self.tokens_saved = 0

    def tick(self) -> None:
        self.now = self.clock()

    def _event(self, kind: str, pin: Pin, detail: float) -> None:
        if self.events is not None:
            self.events.append([kind, pin.job_id, len(pin.blocks), detail])

    # ------------------------------------------------------------------ ordering

    def program_key(self, req: Request) -> float:
        """Program-level FCFS: a job's turns wait by the job's first arrival."""
        job = self.jobs.get(req.job_id) if req.job_id is not None else None
        return job.first_arrival if job is not None else req.arrival_time

    def victim_key(self, req: Request) -> tuple[bool, float]:
        """The largest is preempted first: jobs without a pin, then the latest program."""
        return req.job_id not in self.pins, self.program_key(req)

    # ------------------------------------------------------------------ request events

    def on_arrival(self, req: Request) -> None:
        job_id = req.job_id
        if job_id is None:
            return
        job = self.jobs.get(job_id)
        if job is None:
            if len(self.jobs) >= MAX_JOBS:
                self._forget(next(iter(self.jobs)))
            self.jobs[job_id] = JobState(req.arrival_time)
            return
        if job.last_finish is not None:
            self.gaps.observe(job_id, job.last_tool, self.now - job.last_finish)
            job.last_finish = None
        self.expire()  # an idle engine plans no step: a pin past its TTL is over all the same
        pin = self.pins.get(job_id)
        if pin is not None:  # back in time: its turn claims the pin once admitted
            pin.expected_return = RETURNED
            pin.expires_at = float("inf")

    def on_finish(self, req: Request, status: RequestStatus) -> None:
        """Before the request's blocks are freed: pin them, or let them go."""
        job_id = req.job_id
        if job_id is None:
            return
        job = self.jobs.get(job_id)
        natural = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        if job is None or req.is_last_step or not natural:
            # the program ended (or gave up on this turn): nothing comes back for its KV
            self._release(job_id, "end" if natural else "abort")
            if req.is_last_step or not natural:
                self._forget(job_id)
            return
        job.last_finish = self.now
        job.last_tool = req.tool_name
        self._release(job_id, "replaced")  # at most one pin per job: the newest
        ttl = self.gaps.choose(job_id, req.tool_name, self.loss_ratio, self.kvm.usage)
        if ttl <= 0.0:
            self.num_skipped += 1
            return
        blocks = self._prefix_blocks(req)
        if not blocks:
            return
        pin = Pin(job_id, blocks, len(blocks) // self.kvm.num_groups * self.kvm.block_size,
                  job.first_arrival, self.now + ttl,
                  self.now + self.gaps.expected_gap(job_id, req.tool_name))
        self.pins.hold(pin)
        self.num_pins += 1
        self._event("pin", pin, round(ttl, 6))

    def _prefix_blocks(self, req: Request) -> list[KVCacheBlock]:
        """The blocks the job's next turn would hit: the request's cached prefix."""
        hits, _ = self.kvm.coordinator.find_longest_cache_hit(
            req.block_hashes, len(req.block_hashes))
        return [b for group in hits for b in group if not b.is_null]

    def on_admitted(self, req: Request, num_hit_tokens: int) -> None:
        """After the admission's allocation: the request's own table holds the blocks now."""
        if req.job_id is None:
            return
        pin = self.pins.release(req.job_id)
        if pin is not None:
            saved = min(num_hit_tokens, pin.num_tokens)
            self.num_claims += 1
            self.tokens_saved += saved
            self._event("claim", pin, saved)

    # ------------------------------------------------------------------ releases

    def expire(self) -> None:
        for job_id in self.pins.expired(self.now):
            pin = self.pins.release(job_id)
            assert pin is not None
            self.num_expiries += 1
            self._event("expire", pin, 0)

    def relieve(self, for_req: Request | None, strict: bool) -> bool:
        """Release one pin to make room; False when none may go. For an admission (strict),
        only a pin of a job that started after ``for_req``'s may go: program-level FCFS."""
        own = for_req.job_id if for_req is not None else None
        limit = self.program_key(for_req) if strict and for_req is not None else None
        for pin in self.pins.by_latest_return():
            if pin.job_id == own or (limit is not None and pin.program_key <= limit):
                continue
            self.pins.release(pin.job_id)
            self.num_pressure_releases += 1
            self._event("pressure", pin, 0)
            return True
        return False

    def _release(self, job_id: str, why: str) -> None:
        pin = self.pins.release(job_id)
        if pin is not None:
            self._event(why, pin, 0)

    def _forget(self, job_id: str) -> None:
        self._release(job_id, "end")
        self.jobs.pop(job_id, None)
        self.gaps.forget_job(job_id)

    def release_all(self) -> None:
        """Shutdown (or a prefix-cache reset): every pinned block goes back to the pool."""
        for job_id in list(self.pins.pins):
            self._release(job_id, "shutdown")

    # ------------------------------------------------------------------ introspection

    def tables(self) -> Iterator[list[KVCacheBlock]]:
        return self.pins.tables()

    def stats(self) -> dict[str, float]:
        return {
            "continuum_pinned_blocks": float(self.pins.num_blocks),
            "continuum_pins": float(len(self.pins)),
            "continuum_pins_created": float(self.num_pins),
            "continuum_pins_skipped": float(self.num_skipped),
            "continuum_pin_hits": float(self.num_claims),
            "continuum_pin_expiries": float(self.num_expiries),
            "continuum_pressure_releases": float(self.num_pressure_releases),
            "continuum_tokens_saved": float(self.tokens_saved),
            "continuum_jobs": float(len(self.jobs)),
        }
