"""LoRA in the scheduler: the adapter slots (LRU over slots no running request uses, one op per
load), the per-step adapter budget (skip and keep scanning, the aging guard), preemption, the
priority queue and the whole-fit gate, all against the fake worker, which applies the slot ops
as a rank does and fails on a request whose adapter is in no slot."""

from __future__ import annotations

import random

import pytest

from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Encoder, unpack
from tests.engine_core.fake_worker import (
    FakeWorker,
    lora_token,
    make_request,
    make_scheduler,
    next_token,
    run_async_to_completion,
    run_to_completion,
    tokens_of,
)

BS = 4


def expected(req: Request) -> list[int]:
    """The fake model's greedy tokens for ``req`` alone."""
    toks = list(req.prompt_token_ids)
    out = []
    for _ in range(req.max_tokens):
        t = lora_token(next_token(toks), req.lora_hash)
        toks.append(t)
        out.append(t)
    return out


def lora_sched(max_loras: int, **cfg: object) -> Scheduler:
    cfg.setdefault("block_size", BS)
    return make_scheduler(enable_lora=True, max_loras=max_loras, **cfg)


def step(s: Scheduler, w: FakeWorker) -> None:
    so = s.schedule()
    s.update_from_output(so, w.step(so))
    s.take_outputs()
    s.check_invariants()


def running_adapters(s: Scheduler) -> set[int]:
    return {r.lora_int_id for r in s.running if r.lora is not None}


def test_three_adapters_two_slots_never_three_kinds_and_all_finish() -> None:
    rng = random.Random(0)
    s = lora_sched(2, num_blocks=200, max_num_batched_tokens=32)
    reqs = [
        make_request(f"r{i}", [rng.randrange(10, 99) for _ in range(rng.randrange(3, 12))],
                     max_tokens=rng.randrange(2, 12), lora=1 + i % 3)
        for i in range(12)
    ] + [make_request("base", [11, 12, 13], max_tokens=6)]
    for r in reqs:
        s.add_request(r)
    w = FakeWorker(BS)
    seen: list[set[int]] = []
    outs: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        so = s.schedule()
        kinds = running_adapters(s)
        assert len(kinds) <= 2, kinds
        seen.append(kinds)
        for o in s.update_from_output(so, w.step(so)) + s.take_outputs():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        s.check_invariants()
    assert any(len(k) == 2 for k in seen), "two adapters never ran in one step"
    assert outs == {r.request_id: expected(r) for r in reqs}
    assert len({lid for lid, _ in w.slots.values()}) <= 2


def test_a_request_without_a_slot_is_skipped_and_the_scan_goes_on() -> None:
    s = lora_sched(1, num_blocks=100, max_num_batched_tokens=64)
    order = [("a1", 1), ("b1", 2), ("c1", 3), ("a2", 1), ("base", 0), ("b2", 2)]
    reqs = [make_request(rid, [20, 21, 22], max_tokens=3, lora=lid) for rid, lid in order]
    for r in reqs:
        s.add_request(r)
    w = FakeWorker(BS)
    so = s.schedule()
    first = s.update_from_output(so, w.step(so))
    admitted = {r.request_id for r in s.running}
    assert admitted == {"a1", "a2", "base"}
    # skipped requests are back at the front, in their order
    assert [r.request_id for r in s.waiting] == ["b1", "c1", "b2"]
    assert so.lora is not None and len(so.lora.ops) == 1
    new = {nr.handle: nr for nr in so.new_reqs}
    pairs = dict(zip(unpack(so.lora.handles), unpack(so.lora.lora_int_ids), strict=True))
    assert sorted(pairs.values()) == [1, 1]  # the base request is not listed
    assert set(pairs) < set(new)
    outs = run_to_completion(s, w)
    for o in first:
        outs.setdefault(o.request_id, []).insert(0, o)
    assert {k: tokens_of(v) for k, v in outs.items()} == {r.request_id: expected(r) for r in reqs}


@pytest.mark.parametrize("policy", ["priority", "continuum"])
def test_skipped_requests_keep_their_queue_order(policy: str) -> None:
    s = lora_sched(1, num_blocks=100, max_num_batched_tokens=64, scheduling_policy=policy)
    for rid, lid, prio in [("b1", 2, 1), ("a1", 1, 0), ("c1", 3, 2), ("b2", 2, 3)]:
        # continuum orders by arrival (no jobs here), priority by priority: the same order
        s.add_request(make_request(rid, [30, 31], max_tokens=2, lora=lid, priority=prio,
                                   arrival=float(prio)))
    s.schedule()
    assert [r.request_id for r in s.running] == ["a1"]
    assert [r.request_id for r in s.waiting] == ["b1", "c1", "b2"]


def _stream_until_b_finishes(starvation_passes: int, steps: int) -> tuple[int | None, int]:
    """max_loras 1: adapter 1 gets a new request every step; one request of adapter 2
    arrives early. Returns the step at which adapter 2's request finished (None: not within
    ``steps``) and how many adapter-1 requests were admitted meanwhile."""
    s = lora_sched(1, num_blocks=400, max_num_batched_tokens=256, max_num_seqs=64)
    assert s.lora is not None
    s.lora.starvation_passes = starvation_passes
    w = FakeWorker(BS)
    s.add_request(make_request("a0", [40, 41, 42], max_tokens=6, lora=1))
    step(s, w)
    s.add_request(make_request("b", [50, 51, 52], max_tokens=3, lora=2))
    done = None
    for k in range(steps):
        s.add_request(make_request(f"a{k + 1}", [40, 41, k % 50 + 10], max_tokens=6, lora=1))
        so = s.schedule()
        outs = s.update_from_output(so, w.step(so)) + s.take_outputs()
        s.check_invariants()
        if any(o.request_id == "b" and o.finish_reason for o in outs):
            done = k
            break
    return done, s.lora.num_loads


def test_the_aging_guard_lets_a_starving_adapter_in() -> None:
    done, loads = _stream_until_b_finishes(starvation_passes=4, steps=200)
    assert done is not None, "adapter 2 starved behind a stream of adapter-1 requests"
    assert loads >= 2
    # without the guard the stream keeps adapter 1 pinned: adapter 2 never gets its slot
    done, _ = _stream_until_b_finishes(starvation_passes=10**9, steps=200)
    assert done is None


def test_slots_are_lru_and_each_load_is_one_op() -> None:
    s = lora_sched(2, num_blocks=100, max_num_batched_tokens=64)
    w = FakeWorker(BS)

    def run(rid: str, lid: int) -> None:
        s.add_request(make_request(rid, [60, 61, 62], max_tokens=2, lora=lid))
        run_to_completion(s, w)

    run("x1", 1)  # slot 0
    run("x2", 1)  # already there: no op
    run("y", 2)  # slot 1
    run("z", 3)  # evicts 1, the least recently used
    run("x3", 1)  # evicts 2
    run("y2", 3)  # still there
    ops = [(op.slot, op.lora_int_id) for op in w.lora_ops]
    assert ops == [(0, 1), (1, 2), (0, 3), (1, 1)]
    op = w.lora_ops[0]
    assert (op.lora_name, op.lora_path, op.content_hash) == ("a1", "/adapters/a1", f"{7919:06x}")
    assert s.lora is not None and s.lora.num_loads == 4 and s.lora.num_evictions == 2


def test_an_adapter_running_keeps_its_slot_and_a_new_one_waits() -> None:
    s = lora_sched(1, num_blocks=100, max_num_batched_tokens=64)
    w = FakeWorker(BS)
    s.add_request(make_request("long", [70, 71], max_tokens=8, lora=1))
    step(s, w)
    s.add_request(make_request("other", [72, 73], max_tokens=2, lora=2))
    for _ in range(6):
        step(s, w)
        assert [r.request_id for r in s.waiting] == ["other"]
    outs = run_to_completion(s, w)
    assert outs["other"][-1].finish_reason == "length"


def _preempting_workload(seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        make_request(f"p{i}", [rng.randrange(10, 99) for _ in range(rng.randrange(2, 12))],
                     max_tokens=rng.randrange(4, 20), lora=rng.choice([0, 1, 2, 3]))
        for i in range(12)
    ]


def test_preemption_gives_the_slot_back_and_outputs_are_unchanged() -> None:
    for policy in ("fcfs", "priority"):
        preempted = 0.0
        for seed in range(3):
            results = []
            for num_blocks in (400, 10):
                s = lora_sched(2, num_blocks=num_blocks, max_num_batched_tokens=16,
                               scheduling_policy=policy)
                reqs = _preempting_workload(seed)
                for r in reqs:
                    s.add_request(r)
                outs = run_to_completion(s, FakeWorker(BS))
                results.append({k: tokens_of(v) for k, v in outs.items()})
                assert results[-1] == {r.request_id: expected(r) for r in reqs}
                assert s.lora is not None and not s.lora.pins
                if num_blocks == 10:
                    preempted += s.get_stats()["num_preemptions"]
            assert results[0] == results[1]
        assert preempted > 0, "the tight runs never preempted"


def test_async_scheduling_and_the_whole_fit_gate() -> None:
    for cfg in ({"async_scheduling": True}, {"scheduler_reserve_full_isl": True}):
        s = lora_sched(2, num_blocks=24, max_num_batched_tokens=16, **cfg)
        reqs = _preempting_workload(7)
        for r in reqs:
            s.add_request(r)
        runner = run_async_to_completion if cfg.get("async_scheduling") else run_to_completion
        outs = runner(s, FakeWorker(BS))
        assert {k: tokens_of(v) for k, v in outs.items()} == {r.request_id: expected(r)
                                                              for r in reqs}


def test_prefix_cache_isolates_base_adapters_and_new_weights() -> None:
    prompt = list(range(20, 33))  # three full blocks

    def hashes(**kw: object) -> list:
        s = lora_sched(2, enable_prefix_caching=True)
        r = make_request("h", prompt, **kw)  # type: ignore[arg-type]
        s.kv_cache_manager.attach_hasher(r)
        return r.block_hashes

    base, a1, a2 = hashes(), hashes(lora=1), hashes(lora=2)
    a1_new = hashes(lora=1, lora_hash="feed01")
    assert len(base) == 3
    for one, other in [(base, a1), (base, a2), (a1, a2), (a1, a1_new)]:
        assert not set(one) & set(other)
    assert hashes(lora=1) == a1  # the same adapter and weights share
    # base blocks are the same with LoRA enabled and without
    plain = make_scheduler(block_size=BS)
    r = make_request("h", prompt)
    plain.kv_cache_manager.attach_hasher(r)
    assert r.block_hashes == base

    # through the scheduler: a hit only for the same adapter and weights (the fake worker
    # would also fail on a block computed under another adapter)
    s = lora_sched(2, num_blocks=100, max_num_batched_tokens=64)
    w = FakeWorker(BS)
    cached = {}
    for rid, kw in [("base", {}), ("a1", {"lora": 1}), ("a2", {"lora": 2}),
                    ("a1-new", {"lora": 1, "lora_hash": "feed01"}), ("a1-again", {"lora": 1}),
                    ("base-again", {})]:
        req = make_request(rid, prompt, max_tokens=2, **kw)  # type: ignore[arg-type]
        s.add_request(req)
        run_to_completion(s, w)
        cached[rid] = req.num_cached_tokens
    assert cached == {"base": 0, "a1": 0, "a2": 0, "a1-new": 0, "a1-again": 12,
                      "base-again": 12}


def test_a_base_request_costs_the_wire_no_byte() -> None:
    """The same base-model workload gives byte-identical step plans with LoRA on and off."""

    def frames(**cfg: object) -> list[bytes]:
        s = make_scheduler(num_blocks=50, max_num_batched_tokens=16, block_size=BS, **cfg)
        rng = random.Random(3)
        for i in range(6):
            s.add_request(make_request(f"r{i}", [rng.randrange(10, 99) for _ in range(9)],
                                       max_tokens=5))
        enc, w, out = Encoder(), FakeWorker(BS), []
        while s.has_unfinished_requests():
            so = s.schedule()
            out.append(bytes(enc.encode(so)))
            s.update_from_output(so, w.step(so))
        return out

    off = frames()
    assert frames(enable_lora=True, max_loras=2) == off


def test_unload_empties_the_slot_in_a_step_of_its_own() -> None:
    s = lora_sched(2, num_blocks=100, max_num_batched_tokens=64)
    w = FakeWorker(BS)
    s.add_request(make_request("x", [80, 81], max_tokens=2, lora=1))
    run_to_completion(s, w)
    assert s.lora is not None and not s.has_unfinished_requests()
    assert s.lora.forget(1) and not s.lora.forget(5)
    assert s.has_unfinished_requests()  # the op must reach the ranks even when idle
    so = s.schedule()
    assert so.lora is not None and [(o.slot, o.lora_int_id) for o in so.lora.ops] == [(0, 0)]
    s.update_from_output(so, w.step(so))
    assert not s.has_unfinished_requests() and w.slots == {}
