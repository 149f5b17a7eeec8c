"""The unified token budget, on hand-worked steps (block_size 4, plenty of KV blocks)."""

from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from tests.engine_core.fake_worker import FakeWorker, make_request, make_scheduler


def step(s: Scheduler, w: FakeWorker, reqs: list[Request]) -> dict[str, int]:
    """One step; returns {request id: tokens scheduled} as the worker saw it."""
    so = s.schedule()
    s.update_from_output(so, w.step(so))
    s.check_invariants()
    names = {r.handle: r.request_id for r in reqs if r.handle is not None}
    return {names[h]: n for h, n in w.last_num_scheduled.items()}


def setup(**cfg: object) -> tuple[Scheduler, FakeWorker, list[Request]]:
    s = make_scheduler(num_blocks=200, max_num_batched_tokens=10, block_size=4, **cfg)
    reqs = [
        make_request("A", [1, 2, 3], max_tokens=50),
        make_request("B", [4, 5, 6], max_tokens=50),
        make_request("C", list(range(20, 40)), max_tokens=50),  # 20-token prompt
    ]
    for r in reqs:
        s.add_request(r)
    return s, FakeWorker(4), reqs


def test_decodes_chunks_and_new_prompts_share_one_budget() -> None:
    s, w, reqs = setup()
    assert step(s, w, reqs) == {"A": 3, "B": 3, "C": 4}  # C's prompt is chunked into the rest
    reqs.append(make_request("D", [7] * 5, max_tokens=50))
    s.add_request(reqs[-1])
    assert step(s, w, reqs) == {"A": 1, "B": 1, "C": 8}  # D waits: budget spent
    assert step(s, w, reqs) == {"A": 1, "B": 1, "C": 8}  # C's prompt done: 4+8+8 = 20
    assert step(s, w, reqs) == {"A": 1, "B": 1, "C": 1, "D": 5}


def test_long_prefill_threshold_caps_every_chunk() -> None:
    s, w, reqs = setup(long_prefill_token_threshold=4)
    assert step(s, w, reqs) == {"A": 3, "B": 3, "C": 4}
    reqs.append(make_request("D", [7] * 5, max_tokens=50))
    s.add_request(reqs[-1])
    assert step(s, w, reqs) == {"A": 1, "B": 1, "C": 4, "D": 4}
    assert step(s, w, reqs) == {"A": 1, "B": 1, "C": 4, "D": 1}


def test_chunked_prefill_off_admits_only_whole_prompts() -> None:
    s = make_scheduler(
        num_blocks=200, max_num_batched_tokens=10, block_size=4, enable_chunked_prefill=False
    )
    reqs = [
        make_request("A", [1, 2, 3], max_tokens=50),
        make_request("B", [4, 5, 6], max_tokens=50),
        make_request("C", list(range(20, 28)), max_tokens=50),  # 8 tokens: not in the 4 left
        make_request("D", [7] * 5, max_tokens=50),
    ]
    for r in reqs:
        s.add_request(r)
    w = FakeWorker(4)
    assert step(s, w, reqs) == {"A": 3, "B": 3}  # FCFS: D may not overtake C
    assert step(s, w, reqs) == {"A": 1, "B": 1, "C": 8}
    assert step(s, w, reqs) == {"A": 1, "B": 1, "C": 1, "D": 5}


def test_max_num_seqs_limits_the_running_set() -> None:
    s = make_scheduler(num_blocks=200, max_num_batched_tokens=10, block_size=4, max_num_seqs=2)
    reqs = [
        make_request("A", [1, 2, 3], max_tokens=2),
        make_request("B", [4, 5, 6], max_tokens=50),
        make_request("C", [8, 9], max_tokens=50),
    ]
    for r in reqs:
        s.add_request(r)
    w = FakeWorker(4)
    assert step(s, w, reqs) == {"A": 3, "B": 3}
    assert step(s, w, reqs) == {"A": 1, "B": 1}  # A reaches max_tokens=2 and finishes
    assert step(s, w, reqs) == {"B": 1, "C": 2}


def test_near_max_model_len() -> None:
    s = make_scheduler(num_blocks=200, max_model_len=8, max_num_batched_tokens=10, block_size=4)
    w = FakeWorker(4)
    reqs = [
        make_request("A", [1] * 6, max_tokens=50),
        make_request("B", [2] * 8, max_tokens=50),  # exactly max_model_len: one token
        make_request("C", [3] * 9, max_tokens=50),  # too long: refused, nothing crashes
    ]
    for r in reqs:
        s.add_request(r)
    (refused,) = s.take_outputs()
    assert refused.request_id == "C" and refused.finish_reason == "error"
    assert refused.error == "prompt has 9 tokens, more than max_model_len 8"
    assert step(s, w, reqs) == {"A": 6, "B": 4}  # budget 10
    # A: 6 prompt + 2 outputs = 8 = max_model_len -> length; B: 8 + 1 -> length
    assert step(s, w, reqs) == {"A": 1, "B": 4}
    assert not s.has_unfinished_requests()
    assert [r.num_output_tokens for r in reqs] == [2, 1, 0]
    assert reqs[0].status.name == reqs[1].status.name == "FINISHED_LENGTH_CAPPED"
