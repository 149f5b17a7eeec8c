"""Waiting queues: FCFS (a deque), PRIORITY and CONTINUUM (heaps).

Preempted requests go back to the *front* of the FCFS queue (they were admitted first), and so
do requests admission skipped (for want of an adapter slot), in their order; the
priority heap orders by (priority, arrival_time, request_id), lower values first; the
continuum heap by (the job's first arrival, arrival_time, request_id): program-level FCFS,
so a job's later turn goes before jobs that started after it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from engine_core.request import Request


class RequestQueue(Protocol):
    def add_request(self, request: Request) -> None: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: list[Request]) -> None: ...
    def peek_request(self) -> Request: ...
    def pop_request(self) -> Request: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def __bool__(self) -> bool: ...


class FCFSRequestQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._q.append(request)

    def prepend_request(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_requests(self, requests: list[Request]) -> None:
        """Put ``requests`` back at the front, in their order (admission's skipped ones)."""
        self._q.extendleft(reversed(requests))

    def peek_request(self) -> Request:
        return self._q[0]

    def pop_request(self) -> Request:
        return self._q.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._q = deque(r for r in self._q if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class _KeyedHeapQueue:
    """Heap of (key(request), arrival_time, request_id, request); ids are unique, so the
    request object itself is never compared. The key is fixed when a request is added, and a
    preempted request goes back by the same key."""

    def __init__(self, key: Callable[[Request], float]) -> None:
        self._heap: list[tuple[float, float, str, Request]] = []
        self._key = key

    def add_request(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (self._key(request), request.arrival_time, request.request_id, request)
        )

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: list[Request]) -> None:
        for r in requests:  # their keys put them back where they were
            self.add_request(r)

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[3]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In queue order (sorts a copy: for inspection, not for hot paths)."""
        return iter([e[3] for e in sorted(self._heap, key=lambda e: e[:3])])


class PriorityRequestQueue(_KeyedHeapQueue):
    """Lowest priority value first, then arrival."""

    def __init__(self) -> None:
        super().__init__(lambda r: r.priority)


class ContinuumRequestQueue(_KeyedHeapQueue):
    """Program-level FCFS: the key is the request's job's first arrival (its own arrival
    without a job), so a job's later turn goes before jobs that started after it."""

    def __init__(self, program_key: Callable[[Request], float]) -> None:
        super().__init__(program_key)


WaitingQueue = FCFSRequestQueue | PriorityRequestQueue | ContinuumRequestQueue


def create_request_queue(
    policy: str, program_key: Callable[[Request], float] | None = None
) -> WaitingQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    if policy == "continuum":
        assert program_key is not None, "the continuum queue orders by the job's first arrival"
        return ContinuumRequestQueue(program_key)
    raise ValueError(
        f"unknown scheduling_policy {policy!r} (expected 'fcfs', 'priority' or 'continuum')"
    )
