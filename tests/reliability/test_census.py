"""The Python API under a bound on waiting requests, and the census of every process.

- max_queued_requests: a call that does not fit raises QueueFullError before anything is sent;
  requests already admitted are served to their last token;
- after requests aborted mid-flight, streams closed early, requests failing in the workers and
  requests the engine core refuses, every per-request map of the frontend, the engine core and
  both ranks (LLM.census()) is back to empty and every KV block is free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from launch import LLM, QueueFullError, SamplingParams
from launch.census import Census, leftovers
from tests.helpers.procs import wait_no_descendants

FAULT_SEED = 626262  # a new request with this seed fails in the workers (request_guard.py)
LIMIT = 3
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_FAULT_REQUEST_SEED", str(FAULT_SEED))  # read by the workers at start
        engine = LLM("dummy:micro", 2, load_tokenizer=False, max_num_seqs=1,
                     max_queued_requests=LIMIT, num_gpu_blocks_override=256,
                     startup_timeout_s=120)
    try:
        yield engine
    finally:
        engine.shutdown()
        assert wait_no_descendants(10) == []


def wait_empty(llm: LLM, timeout_s: float = 30.0) -> Census:
    """Poll the census until no per-request map holds anything (ranks report every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        census = llm.census()
        free = llm.get_stats()["num_free_blocks"]
        if set(census) >= {"rank0", "rank1"} and not leftovers(census) \
                and free == llm.info.num_blocks - 1:
            return census
        assert time.monotonic() < deadline, f"not empty after {timeout_s} s: {census}, {free}"
        time.sleep(0.1)


def test_full_queue_raises_and_admitted_requests_are_served(llm: LLM) -> None:
    wait_empty(llm)
    with pytest.raises(QueueFullError, match=f"max_queued_requests={LIMIT}"):
        llm.generate([[5, 6]] * (LIMIT + 1), SHORT, use_tqdm=False)
    assert llm.client is not None and not llm.client.tracked  # nothing was sent

    blocker = llm.generate_stream([[5, 6, 7]], LONG)
    first = next(blocker)  # the one running slot is taken
    queued: list[Any] = []
    worker = threading.Thread(  # these wait behind the blocker
        target=lambda: queued.extend(llm.generate([[7, 8]] * LIMIT, SHORT, use_tqdm=False,
                                                  timeout_s=120)))
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while llm.client.admission.queued < LIMIT:
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.01)
        try:
            llm.generate([[9, 9]], SHORT, use_tqdm=False)
            refused = False
        except QueueFullError:
            refused = True
        # refused for sure while the blocker still held the slot
        assert refused or first.request_id not in llm.client.tracked
    finally:
        blocker.close()  # aborts the blocker: the queued requests run
        worker.join(120)
    assert not worker.is_alive()
    assert [o.finish_reason for o in queued] == ["length"] * LIMIT
    assert all(len(o.token_ids) == SHORT.max_tokens for o in queued)
    wait_empty(llm)


def test_census_is_empty_after_aborts_closes_and_errors(llm: LLM) -> None:
    idle = wait_empty(llm)
    assert set(idle) == {"frontend", "engine_core", "rank0", "rank1"}
    # a stream in flight: every process holds it; then its client aborts it
    stream = llm.generate_stream([[5, 6, 7]], LONG)
    first = next(stream)
    deadline = time.monotonic() + 30
    while True:  # the ranks report with each pong (every 0.5 s)
        busy = llm.census()
        if all(busy.get(r, {}).get("input_batch.states") for r in ("rank0", "rank1")):
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)
    assert busy["engine_core"]["scheduler.running"] == 1
    assert busy["frontend"]["client.tracked"] == 1
    llm.abort([first.request_id])
    ends = [ev for ev in stream if ev.finish_reason is not None]
    assert [e.finish_reason for e in ends] == ["abort"]
    # a request failing in the workers mid-flight, one the engine core refuses (a token id
    # outside the vocabulary) and one that runs, in one call
    bad = SamplingParams(max_tokens=8, temperature=0.8, seed=FAULT_SEED)
    outs = llm.generate([[5, 6], [5, 99999], [6, 7]], [bad, SHORT, SHORT], use_tqdm=False,
                        timeout_s=60)
    assert [o.finish_reason for o in outs] == ["error", "error", "length"]
    assert "injected request fault" in (outs[0].error or "")
    assert "outside the vocabulary" in (outs[1].error or "")
    # a stream closed early (its requests are aborted: one running, the others waiting)
    early = llm.generate_stream([[8, 9]] * LIMIT, LONG)
    next(early)
    early.close()
    wait_empty(llm)


def test_a_late_health_report_answers_nobody(llm: LLM) -> None:
    """A report whose caller timed out is dropped, not handed to the next caller (which would
    then leave its own report behind, and every later call would be one report late)."""
    assert llm.client is not None
    try:
        llm.health(timeout_s=0.0)
        timed_out = False
    except TimeoutError:
        timed_out = True
    time.sleep(0.5)  # the late report arrives
    llm.health()
    time.sleep(0.5)  # and this call's own report, had the call taken the late one instead
    if timed_out:
        assert llm.client.replies.qsize() == 0
