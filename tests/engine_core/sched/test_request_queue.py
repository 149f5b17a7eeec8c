import pytest

from engine_core.request import Request
from engine_core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)
from protocol.messages import SamplingParams
from protocol.request_options import RequestOptions


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2], SamplingParams(), None, arrival,
                   RequestOptions(priority=priority))


def test_fcfs_order_prepend_and_remove() -> None:
    q = FCFSRequestQueue()
    a, b, c = req("a"), req("b"), req("c")
    for r in (a, b, c):
        q.add_request(r)
    assert q.pop_request() is a
    q.prepend_request(a)  # a preempted request goes back to the front
    assert [r.request_id for r in q] == ["a", "b", "c"]
    q.remove_requests([b])
    assert [r.request_id for r in q] == ["a", "c"] and len(q) == 2
    assert q.peek_request() is a


def test_priority_order_priority_then_arrival_then_id() -> None:
    q = PriorityRequestQueue()
    rs = [req("x", 1, 0.0), req("b", 0, 2.0), req("a", 0, 2.0), req("c", 0, 1.0)]
    for r in rs:
        q.add_request(r)
    assert [r.request_id for r in q] == ["c", "a", "b", "x"]
    assert q.pop_request().request_id == "c"
    q.remove_requests([rs[2]])
    assert [q.pop_request().request_id for _ in range(len(q))] == ["b", "x"]
    assert not q


def test_create_request_queue() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError):
        create_request_queue("lifo")
