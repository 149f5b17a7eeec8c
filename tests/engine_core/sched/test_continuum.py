"""The continuum policy with the fake worker and an injected clock: pins on finish, claims by
the next turn, expiry, release under pressure, program-level order, preemption choice, abort
of a pinned job, TTL learning, and an exact trace replay."""

from __future__ import annotations

import io
from typing import Any

from engine_core.request import Request, RequestStatus
from engine_core.sched.continuum.ttl import COLD_START_TTL_S, GapModel, best_ttl
from engine_core.sched.replay import read_trace, replay
from engine_core.sched.scheduler import Scheduler
from engine_core.sched.trace import SchedulerTrace, trace_header
from protocol.config import EngineConfig
from protocol.messages import SamplingParams
from protocol.request_options import JobInfo, RequestOptions
from tests.engine_core.fake_worker import FakeWorker, run_to_completion, tokens_of

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sched(num_blocks: int = 32, clock: Clock | None = None, budget: int = 64,
          **cfg: Any) -> Scheduler:
    config = EngineConfig(debug_invariants=True, block_size=BS, scheduling_policy="continuum",
                          **cfg)
    return Scheduler(config, num_blocks, 256, budget, None, clock=clock or Clock())


def turn(rid: str, prompt: list[int], job: str | None, arrival: float = 0.0, last: bool = False,
         tool: str | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), None, arrival,
                   RequestOptions(job=None if job is None else JobInfo(
                       job_id=job, is_last_step=last, tool_name=tool)))


def stats(s: Scheduler) -> dict[str, float]:
    return s.get_stats()


def free_all(s: Scheduler) -> bool:
    return s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks - 1


def step(s: Scheduler, w: FakeWorker) -> None:
    so = s.schedule()
    s.update_from_output(so, w.step(so))


def first_turn(s: Scheduler, w: FakeWorker, job: str = "j", n: int = 16) -> list[int]:
    prompt = list(range(20, 20 + n))
    outs = run_to_completion(s, w)
    s.add_request(turn(f"{job}-1", prompt, job))
    outs = run_to_completion(s, w)
    return prompt + tokens_of(outs[f"{job}-1"])


def test_pin_on_finish_claimed_by_the_next_turn() -> None:
    s, w = sched(), FakeWorker(BS)
    ctx = first_turn(s, w)
    st = stats(s)
    assert st["continuum_pins"] == 1 and st["continuum_pinned_blocks"] == (len(ctx) - 1) // BS
    s.add_request(turn("j-2", ctx + [50, 51, 52], "j", last=True))
    step(s, w)
    r = s.requests["j-2"]
    assert r.num_cached_tokens == (len(ctx) - 1) // BS * BS  # the pinned prefix was a hit
    st = stats(s)
    assert st["continuum_pin_hits"] == 1 and st["continuum_pins"] == 0
    assert st["continuum_tokens_saved"] == r.num_cached_tokens
    run_to_completion(s, w)  # the last step: nothing stays pinned
    assert stats(s)["continuum_pins"] == 0 and free_all(s)


def test_requests_without_a_job_are_never_pinned() -> None:
    s, w = sched(), FakeWorker(BS)
    s.add_request(turn("a", list(range(20, 40)), None))
    run_to_completion(s, w)
    assert stats(s)["continuum_pins_created"] == 0 and free_all(s)


def test_expired_pins_go_back_at_the_top_of_schedule() -> None:
    clock = Clock()
    s, w = sched(clock=clock, continuum_ttl=1.0), FakeWorker(BS)
    first_turn(s, w)
    clock.now = 0.99
    step(s, w)
    assert stats(s)["continuum_pins"] == 1
    clock.now = 1.0
    step(s, w)
    st = stats(s)
    assert st["continuum_pins"] == 0 and st["continuum_pin_expiries"] == 1 and free_all(s)


def test_a_newer_pin_of_the_same_job_replaces_the_older() -> None:
    s, w = sched(), FakeWorker(BS)
    ctx = first_turn(s, w)
    s.add_request(turn("j-2", ctx + [60] * 9, "j"))
    run_to_completion(s, w)
    assert stats(s)["continuum_pins"] == 1 and stats(s)["continuum_pins_created"] == 2


def test_pressure_releases_the_latest_expected_return_first() -> None:
    clock = Clock()
    s, w = sched(num_blocks=14, clock=clock, continuum_ttl=100.0), FakeWorker(BS)
    for job, gap in (("early", 0.5), ("late", 5.0)):
        # teach each job's tool its gap: three observed returns
        for k in range(4):
            s.add_request(turn(f"{job}-{k}", [30 + k + len(job) * 10] * 5, job, tool=job))
            run_to_completion(s, w)
            clock.now += gap
    pins = s.continuum.pins  # type: ignore[union-attr]
    assert set(pins.pins) == {"early", "late"}
    # nothing runs: an admission that needs the room may take any pin, the later return first
    s.add_request(turn("big", list(range(100, 140)), None, arrival=99.0))
    step(s, w)
    assert "late" not in pins.pins and "early" in pins.pins
    assert stats(s)["continuum_pressure_releases"] == 1
    s.check_invariants()


def test_admission_does_not_take_pins_of_earlier_jobs_while_others_run() -> None:
    s, w = sched(num_blocks=12), FakeWorker(BS)
    first_turn(s, w, "old", n=20)  # pins 5 blocks
    s.add_request(turn("runner", [7] * 8, None, arrival=1.0, max_tokens=30))
    step(s, w)
    s.add_request(turn("newcomer", list(range(200, 224)), None, arrival=2.0))
    step(s, w)  # does not fit beside the pin and the runner: it waits
    assert "newcomer" in {r.request_id for r in s.waiting}
    assert stats(s)["continuum_pins"] == 1


def test_a_later_prompt_waits_when_only_its_first_chunk_fits_beside_an_earlier_pin() -> None:
    s, w = sched(num_blocks=12, budget=8), FakeWorker(BS)
    first_turn(s, w, "old", n=20)  # pins 5 blocks
    s.add_request(turn("runner", [7] * 8, None, arrival=1.0, max_tokens=30))
    step(s, w)
    # an 8-token chunk would fit, the 24-token prompt would not: admitted in chunks, its
    # growth would push the older job's pin out
    s.add_request(turn("newcomer", list(range(200, 224)), "new", arrival=2.0))
    for _ in range(3):
        step(s, w)
        assert "newcomer" in {r.request_id for r in s.waiting}
    assert stats(s)["continuum_pins"] == 1
    assert stats(s)["continuum_pressure_releases"] == 0
    s.check_invariants()


def test_program_level_fcfs_puts_an_older_jobs_turn_first() -> None:
    s = sched()
    s.add_request(turn("a-1", [1, 2, 3], "a", arrival=0.0))
    s.add_request(turn("b-1", [4, 5, 6], "b", arrival=1.0))
    s.add_request(turn("x", [7, 8, 9], None, arrival=1.5))
    s.add_request(turn("a-2", [1, 2, 3, 9], "a", arrival=2.0))
    assert [r.request_id for r in s.waiting] == ["a-1", "a-2", "b-1", "x"]


def test_preemption_prefers_a_victim_whose_job_holds_no_pin() -> None:
    s = sched()
    cont = s.continuum
    assert cont is not None
    a = turn("a-2", [1], "a", arrival=0.0)
    b = turn("b-2", [1], "b", arrival=1.0)
    c = turn("c-1", [1], None, arrival=2.0)
    for r in (a, b, c):
        s.add_request(r)
    s.running = [a, b, c]
    # job b holds a pin (say a parallel call of it finished): the latest job without one goes
    cont.pins.pins["b"] = cont.pins.pins.get("b") or _fake_pin("b")
    assert s._pick_victim() is c
    cont.pins.pins["x"] = _fake_pin("x")
    c.job_id = "x"
    assert s._pick_victim() is a
    cont.pins.pins.clear()
    s.running = []


def _fake_pin(job: str) -> Any:
    from engine_core.sched.continuum.pins import Pin

    return Pin(job, [], 0, 0.0, 1.0, 1.0)


def test_abort_of_the_next_turn_releases_the_pin() -> None:
    s, w = sched(), FakeWorker(BS)
    ctx = first_turn(s, w)
    s.add_request(turn("j-2", ctx + [5], "j"))
    s.finish_requests("j-2", RequestStatus.FINISHED_ABORTED)
    st = stats(s)
    assert st["continuum_pins"] == 0 and free_all(s)
    s.check_invariants()


def test_shutdown_releases_every_pin() -> None:
    s, w = sched(), FakeWorker(BS)
    first_turn(s, w)
    s.close()
    assert free_all(s)


def test_ttl_rule_pins_short_gaps_and_skips_gaps_that_cannot_pay() -> None:
    short = [0.2, 0.5, 0.8, 1.0, 1.5]
    ttl = best_ttl(short, 1.0, 1.0, 30.0)
    assert 1.5 <= ttl <= 1.5 * 1.2 + 1e-9
    # gaps past the cap: nothing to gain
    assert best_ttl([10.0, 12.0, 15.0], 1.0, 1.0, 3.0) == 0.0
    # long gaps cost more memory than the recompute they save
    assert best_ttl([15.0, 18.0, 20.0], 1.0, 1.0, 30.0) == 0.0
    # an empty pool charges nothing for the memory: pin up to the longest gap
    assert abs(best_ttl([15.0, 18.0, 20.0], 1.0, 0.0, 30.0) - 20.0 * 1.2) < 3.0


def test_gap_model_uses_the_tool_then_the_job_then_everyone() -> None:
    m = GapModel(max_ttl=30.0)
    assert m.choose("j", "grep", 1.0, 1.0) == COLD_START_TTL_S
    for g in (0.3, 0.4, 0.5):
        m.observe("j", "grep", g)
    for g in (20.0, 25.0, 22.0):
        m.observe("k", "build", g)
    assert 0.5 <= m.choose("j", "grep", 1.0, 1.0) <= 0.6 + 1e-9
    assert m.choose("k", "build", 1.0, 1.0) == 0.0
    assert 0.5 <= m.choose("j", None, 1.0, 1.0) <= 0.6 + 1e-9  # the job's own gaps
    assert m.samples("new", None) is m.overall
    fixed = GapModel(max_ttl=5.0, fixed_ttl=9.0)
    assert fixed.choose("j", None, 1.0, 1.0) == 5.0


def test_learns_gaps_from_arrivals() -> None:
    clock = Clock()
    s, w = sched(clock=clock), FakeWorker(BS)
    ctx = list(range(20, 30))
    for k in range(4):
        s.add_request(turn(f"j-{k}", ctx, "j", tool="ls"))
        ctx = ctx + tokens_of(run_to_completion(s, w)[f"j-{k}"]) + [k + 40]
        clock.now += 0.25
    assert list(s.continuum.gaps.by_tool["ls"]) == [0.25, 0.25, 0.25]  # type: ignore[union-attr]


def test_trace_records_pins_and_replays_exactly() -> None:
    clock = Clock()
    s = sched(num_blocks=16, clock=clock, continuum_ttl=0.5)
    buf = io.BytesIO()
    s.trace = SchedulerTrace(buf, trace_header(s))
    s.connect_trace()
    w = FakeWorker(BS)
    ctxs = {j: list(range(10 + 7 * i, 22 + 7 * i)) for i, j in enumerate("abc")}
    for k in range(3):
        for j in "abc":
            s.add_request(turn(f"{j}-{k}", ctxs[j], j, arrival=float(k), last=k == 2))
            clock.now += 0.2
        outs = run_to_completion(s, w)
        for j in "abc":
            ctxs[j] = ctxs[j] + tokens_of(outs[f"{j}-{k}"]) + [k + 1]
        clock.now += 0.4 if k == 0 else 0.8  # the second gap outlives the TTL
        step(s, w)  # the scheduler looks at its pins before the next turns arrive
    s.close()
    trace = read_trace(buf.getvalue().splitlines())
    events = [e[0] for st in trace.steps.values() for e in st.get("pins", [])]
    assert {"pin", "claim", "expire"} <= set(events), events
    result = replay(trace)
    assert result.mismatches == []
