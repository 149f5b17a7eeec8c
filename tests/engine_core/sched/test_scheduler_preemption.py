"""Preemption under KV pressure, PRIORITY preemption with budget rollback, aborts."""

import random

from engine_core.request import RequestStatus
from protocol.codec import unpack
from tests.engine_core.fake_worker import (
    FakeWorker,
    make_request,
    make_scheduler,
    run_to_completion,
    tokens_of,
)


def workload(seed: int) -> list[tuple[str, list[int], int, int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 99) for _ in range(8)]
    return [
        (
            f"r{i}",
            shared[: rng.randrange(0, 9)] + [rng.randrange(10, 99)] * rng.randrange(1, 14),
            rng.randrange(1, 20),
            rng.randrange(0, 3),
        )
        for i in range(12)
    ]


def run(num_blocks: int, policy: str, seed: int) -> tuple[dict[str, list[int]], float]:
    s = make_scheduler(
        num_blocks=num_blocks, max_num_batched_tokens=16, block_size=4, scheduling_policy=policy
    )
    for rid, prompt, max_tokens, prio in workload(seed):
        s.add_request(make_request(rid, prompt, max_tokens=max_tokens, priority=prio))
    outs = run_to_completion(s, FakeWorker(4))
    assert s.kv_cache_manager.num_free_blocks == num_blocks - 1  # no leak
    return {k: tokens_of(v) for k, v in outs.items()}, s.get_stats()["num_preemptions"]


def test_same_tokens_with_and_without_kv_pressure() -> None:
    for policy in ("fcfs", "priority"):
        preempted = 0.0
        for seed in range(4):
            free, n0 = run(400, policy, seed)
            tight, n1 = run(10, policy, seed)
            assert n0 == 0
            preempted += n1
            assert tight == free
            assert all(len(v) > 0 for v in tight.values())
        assert preempted > 0, "the tight runs never preempted: the test is too easy"


def test_priority_preemption_rolls_back_the_victims_budget() -> None:
    s = make_scheduler(
        num_blocks=5, max_num_batched_tokens=16, block_size=4, scheduling_policy="priority"
    )
    w = FakeWorker(4)
    low = make_request("low", [1, 2, 3, 4], max_tokens=50, priority=5, arrival=0.0)
    s.add_request(low)
    so = s.schedule()
    s.update_from_output(so, w.step(so))  # low: 5 tokens, 1 block
    high = make_request("high", [5, 6, 7, 8, 9, 10, 11], max_tokens=50, priority=0, arrival=1.0)
    s.add_request(high)
    for _ in range(2):  # low grows to 2 blocks, high takes 2: the cache is full
        so = s.schedule()
        s.update_from_output(so, w.step(so))
    assert s.kv_cache_manager.num_free_blocks == 0
    # low is scheduled first (admission order) and fits; high then needs a new block and the
    # worst request, low, is preempted: its token goes back to the budget
    so = s.schedule()
    assert unpack(so.preempted_handles) == [low.handle]
    assert so.total_num_scheduled_tokens == 1 and so.num_running == 1
    assert unpack(so.sched_override_handles) == []  # high gets the default single token
    assert unpack(so.cached_reqs.handles) == [high.handle]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    s.update_from_output(so, w.step(so))
    s.check_invariants()
    assert s.get_stats()["num_preemptions"] == 1


def test_abort_waiting_running_finished_and_unknown() -> None:
    s = make_scheduler(num_blocks=20, max_num_batched_tokens=8, block_size=4, max_num_seqs=2)
    w = FakeWorker(4)
    run_r = make_request("run", [1, 2, 3], max_tokens=50)
    done = make_request("done", [4, 5], max_tokens=1)
    wait = make_request("wait", [6, 7], max_tokens=50)
    for r in (run_r, done, wait):
        s.add_request(r)
    so = s.schedule()
    s.update_from_output(so, w.step(so))  # "done" finishes (max_tokens=1); "wait" waits
    assert done.is_finished and wait.handle is None
    s.finish_requests(["run", "done", "nope"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests("wait", RequestStatus.FINISHED_ABORTED)
    outs = s.take_outputs()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("run", "abort"), ("wait", "abort")]
    so = s.schedule()
    # the workers hear only about requests they knew: done (finished in update) and run
    assert sorted(unpack(so.finished_handles)) == sorted([run_r.handle, done.handle])
    assert so.num_running == 0 and not s.has_unfinished_requests()
    w.step(so)
    s.check_invariants()
    assert s.kv_cache_manager.num_free_blocks == 19


def test_preempting_an_already_scheduled_request_uncaches_its_unwritten_blocks() -> None:
    """PRIORITY: low is scheduled first in a step with a chunk that fills two new blocks,
    which the prefix cache registers; high then needs a block and low, already scheduled, is
    preempted, so the workers never write those two blocks. Their hashes must go, or low's
    resumption (and anyone sharing its prefix) would hit blocks holding no KV; the fake
    worker checks every key read holds the right prefix."""
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=16, block_size=4,
                       scheduling_policy="priority", long_prefill_token_threshold=8)
    w = FakeWorker(4)
    low = make_request("low", list(range(10, 34)), max_tokens=3, priority=5, arrival=0.0)
    s.add_request(low)
    outs: dict[str, list] = {}

    def step() -> None:
        so = s.schedule()
        for o in s.update_from_output(so, w.step(so)) + s.take_outputs():
            outs.setdefault(o.request_id, []).append(o)
        s.check_invariants()

    step()  # low: tokens 0-7 (two blocks)
    s.add_request(make_request("high", [1, 2, 3, 4], max_tokens=3, priority=0, arrival=1.0))
    step()  # low: tokens 8-15; high admitted (one block); the pool is 2 blocks from full
    step()  # low takes the last two blocks for 16-23, high needs one: low is preempted
    assert low.num_preemptions == 1
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests()
    assert len(tokens_of(outs["low"])) == 3 and len(tokens_of(outs["high"])) == 3
