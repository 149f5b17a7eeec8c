"""Property: the wire diffs of any schedule rebuild the scheduler's view on a worker.

Drives the real Scheduler through random arrivals, finishes (stop tokens, length caps),
aborts, preemptions under a tiny KV cache, resumptions, chunked prefills and prefix-cache
hits, with fake one-token model outputs. Every SchedulerOutput goes through the real codec
and is applied to a pure-Python worker model; after every step the worker's view (running
set, block tables, num_computed_tokens, tokens) must equal the scheduler's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_core.request import Request, RequestStatus
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Encoder, broadcast_decoder, worker_decoder
from protocol.config import EngineConfig
from protocol.messages import SamplingParams, SchedulerOutput
from protocol.request_options import RequestOptions

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_model import WorkerModel  # noqa: E402

EOS = 0
VOCAB = 12  # small, so prompts share prefixes (prefix-cache hits) and EOS comes up
ENC, BDEC, WDEC = Encoder(), broadcast_decoder(), worker_decoder()


def check_views(sched: Scheduler, worker: WorkerModel, scheduled: dict[int, int]) -> None:
    kvm = sched.kv_cache_manager
    running = {r.handle: r for r in sched.running}
    assert set(worker.running) == set(running), "running sets differ"
    known = {r.handle for r in sched.requests.values() if r.handle is not None}
    assert set(worker.reqs) == known, "the worker holds different requests"
    for h, req in running.items():
        st_ = worker.reqs[h]
        assert st_.block_ids == kvm.get_block_ids(req), f"block table of {req}"
        assert st_.tokens == req.all_token_ids, f"tokens of {req}"
        # the scheduler advances num_computed_tokens when it schedules, the worker when
        # it executes: they agree once this step's count is added
        assert st_.num_computed_tokens + scheduled.get(h, 0) == req.num_computed_tokens, str(req)
    for req in sched.requests.values():  # preempted ones keep their tokens on the worker
        if req.handle is not None and req.handle not in running:
            assert worker.reqs[req.handle].tokens == req.all_token_ids


def record_events(so: SchedulerOutput, scheduled: dict[int, int]) -> None:
    # coverage of the interesting transitions (pytest --hypothesis-show-statistics)
    if so.preempted_handles:
        event("preemption")
    if so.resumed_reqs:
        event("resumption")
    if so.finished_handles:
        event("finish or abort")
    if any(r.num_computed_tokens for r in so.new_reqs):
        event("prefix-cache hit")
    if so.cached_reqs.handles:
        event("block growth")
    if any(n > 1 for n in scheduled.values()) and so.sched_override_handles:
        event("chunked prefill continues")


@st.composite
def configs(draw: st.DrawFn) -> tuple[EngineConfig, int, int, int]:
    block_size = draw(st.sampled_from([2, 4]))
    cfg = EngineConfig(
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 8])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        prefix_hash="fast",
    )
    num_blocks = draw(st.integers(4, 24))  # tiny: preemption is common
    max_model_len = draw(st.integers(8, 40))
    max_batched = draw(st.integers(4, 32))
    return cfg, num_blocks, max_model_len, max_batched


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(configs(), st.data())
def test_worker_model_tracks_scheduler(
    setup: tuple[EngineConfig, int, int, int], data: st.DataObject
) -> None:
    cfg, num_blocks, max_model_len, max_batched = setup
    sched = Scheduler(cfg, num_blocks, max_model_len, max_batched, eos_token_id=EOS)
    worker = WorkerModel()
    shared_prefix = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=8, max_size=8))
    next_id = 0
    for step in range(data.draw(st.integers(1, 40), label="steps")):
        for _ in range(data.draw(st.integers(0, 3), label="arrivals")):
            k = data.draw(st.integers(0, 8))
            tail = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=12))
            prompt = shared_prefix[:k] + tail or [1]
            sp = SamplingParams(
                max_tokens=data.draw(st.integers(1, 12)),
                min_tokens=data.draw(st.sampled_from([0, 0, 2])),
                temperature=0.0,
            )
            sched.add_request(
                Request(
                    f"r{next_id}",
                    prompt,
                    sp,
                    EOS,
                    float(step),
                    RequestOptions(priority=data.draw(st.integers(0, 2))),
                )
            )
            next_id += 1
        if sched.requests and data.draw(st.integers(0, 4)) == 0:
            victim = data.draw(st.sampled_from(sorted(sched.requests)), label="abort")
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)

        frame = ENC.encode(sched.schedule())
        so = BDEC.decode(frame)  # exactly what a worker would see
        assert isinstance(so, SchedulerOutput)
        scheduled = worker.apply(so)
        record_events(so, scheduled)
        check_views(sched, worker, scheduled)
        sched.check_invariants()

        sample = {h: data.draw(st.integers(0, VOCAB - 1)) for h in sorted(scheduled)}
        mro = WDEC.decode(ENC.encode(worker.execute(so.step_id, sample)))
        sched.update_from_output(so, mro)
        sched.take_outputs()
