"""scheduler_reserve_full_isl: a request is admitted only if the KV cache can hold its whole
sequence next to what the running requests still need, so admitted requests never preempt
each other; outputs are the same with and without the gate (the fake model is deterministic).
"""

from __future__ import annotations

import random

import pytest

from engine_core.sched.scheduler import Scheduler
from tests.engine_core.fake_worker import (
    FakeWorker,
    make_request,
    make_scheduler,
    run_async_to_completion,
    run_to_completion,
    tokens_of,
)

BS = 4


def thrash_workload(seed: int, n: int = 16) -> list[tuple[str, list[int], int]]:
    """Short prompts, long outputs: the first chunk of each fits easily, the whole does not."""
    rng = random.Random(seed)
    return [
        (
            f"r{i}",
            [rng.randrange(10, 99) for _ in range(rng.randrange(3, 30))],
            rng.randrange(20, 40),
        )
        for i in range(n)
    ]


def run(gate: bool, seed: int, num_blocks: int = 24, async_scheduling: bool = False, **cfg: object
        ) -> tuple[dict[str, list[int]], Scheduler]:
    s = make_scheduler(
        num_blocks=num_blocks,
        max_num_batched_tokens=16,
        block_size=BS,
        scheduler_reserve_full_isl=gate,
        async_scheduling=async_scheduling,
        **cfg,
    )
    for rid, prompt, max_tokens in thrash_workload(seed):
        s.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    w = FakeWorker(BS)
    outs = run_async_to_completion(s, w) if async_scheduling else run_to_completion(s, w)
    assert s.kv_cache_manager.num_free_blocks == num_blocks - 1  # nothing leaked
    return {k: tokens_of(v) for k, v in outs.items()}, s


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_gate_stops_the_thrash_with_identical_outputs(policy: str, async_scheduling: bool) -> None:
    without = with_gate = 0.0
    for seed in range(3):
        free, s0 = run(False, seed, async_scheduling=async_scheduling, scheduling_policy=policy)
        gated, s1 = run(True, seed, async_scheduling=async_scheduling, scheduling_policy=policy)
        assert gated == free
        assert all(len(t) > 0 for t in gated.values())
        without += s0.get_stats()["num_preemptions"]
        with_gate += s1.get_stats()["num_preemptions"]
    print(f"\n{policy} async={async_scheduling}: preemptions {without:.0f} without, "
          f"{with_gate:.0f} with the gate")
    assert without >= 16, "the workload does not thrash without the gate: the test is too easy"
    assert with_gate == 0


def test_long_prompt_chunks_do_not_preempt_themselves() -> None:
    """vLLM issue 37307's loop: a long chunked prompt is admitted on its first chunk while the
    decodes keep growing; the decodes or the prompt get preempted again and again."""
    def go(gate: bool) -> tuple[dict[str, list[int]], float]:
        s = make_scheduler(num_blocks=20, max_num_batched_tokens=8, block_size=BS,
                           scheduler_reserve_full_isl=gate)
        for i in range(3):
            s.add_request(make_request(f"d{i}", [11 + i, 12, 13], max_tokens=30))
        s.add_request(make_request("long", list(range(20, 60)), max_tokens=10))
        outs = run_to_completion(s, FakeWorker(BS))
        return {k: tokens_of(v) for k, v in outs.items()}, s.get_stats()["num_preemptions"]

    free, n0 = go(False)
    gated, n1 = go(True)
    assert gated == free
    assert n0 > 0 and n1 == 0


def test_a_request_too_big_to_reserve_still_runs_alone() -> None:
    """Its whole sequence exceeds the cache: waiting would not help, so it runs when nothing
    else does (and is length-capped where the cache ends, as without the gate)."""
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=16, block_size=BS,
                       scheduler_reserve_full_isl=True)
    s.add_request(make_request("big", [1, 2, 3], max_tokens=100))
    s.add_request(make_request("small", [4, 5, 6], max_tokens=2))
    outs = run_to_completion(s, FakeWorker(BS))
    assert outs["big"][-1].finish_reason == "length"
    assert len(tokens_of(outs["big"])) == 5 * BS - 3 + 1  # 5 usable blocks, then capped
    assert tokens_of(outs["small"]) and outs["small"][-1].finish_reason == "length"


def test_prefix_hits_held_by_a_running_request_reduce_what_is_reserved() -> None:
    shared = list(range(30, 46))  # 4 full blocks
    s = make_scheduler(num_blocks=12, max_num_batched_tokens=64, block_size=BS,
                       scheduler_reserve_full_isl=True)
    w = FakeWorker(BS)
    s.add_request(make_request("a", shared + [1], max_tokens=3))  # 19 slots: 5 blocks
    so = s.schedule()
    s.update_from_output(so, w.step(so))
    # b needs 7 blocks for its whole sequence (27 slots), 4 of them a's cached prefix: 3 new
    # ones, while 11 - 5 = 6 are free and a needs no more; counted without its hits, b's 7
    # would not fit
    b = make_request("b", shared + [2, 3, 4, 5], max_tokens=8)
    s.add_request(b)
    kvm = s.kv_cache_manager
    assert kvm.num_free_blocks == 6 and kvm.num_blocks_to_hold(b, 27) == 7
    so = s.schedule()
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert len(so.new_reqs) == 1 and so.new_reqs[0].num_computed_tokens == 16


def test_gate_is_off_by_default() -> None:
    s = make_scheduler()
    assert s.reserve_full_isl is False and s.trace is None
