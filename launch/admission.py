"""The bound on waiting requests (--max-queued-requests): how many requests are admitted but
not yet running, and a fast refusal beyond it.

Queued, as vLLM and SGLang count it, is waiting, not running. The frontend decides, before it
tokenizes anything, from what it knows at that moment:

    queued = held + in transit + waiting in the core

- held: requests the frontend has accepted and is still preparing (reading, tokenizing,
  compiling a grammar): a Ticket holds their slots until each becomes an AddRequest;
- in transit: AddRequests sent that the core has not yet reported reading. Every frame the
  frontend sends is numbered; every EngineOutputs says how many frames the core has read, so
  a request stops counting here the moment the core's own count takes it over;
- waiting in the core, as of its latest EngineOutputs: the scheduler's waiting queue
  (preempted requests included) and the requests held until their grammar compiled.

Between two reports the core's figure can only have fallen (requests started running) or
risen by what the frontend sent (counted in transit) or by a preemption, so the sum is an upper
bound but for preemptions: the bound never lets more than N new requests wait. Preempted
requests count against new arrivals but are never dropped: a request admitted is served.
"""

from __future__ import annotations

import threading
from collections import deque

# what a refused client is told to wait before retrying (HTTP Retry-After, in seconds)
RETRY_AFTER_S = 1


class QueueFullError(RuntimeError):
    """max_queued_requests requests are admitted but not yet running; retry later."""


class QueueBound:
    """Thread-safe: the Python API submits from any thread, the server from its event loop."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held = 0
        self._frames_sent = 0
        # numbers of the AddRequest frames the core has not reported reading, oldest first
        self._in_transit: deque[int] = deque()
        self._frames_seen = 0
        self._core_waiting = 0

    @property
    def queued(self) -> int:
        with self._lock:
            return self._queued()

    def _queued(self) -> int:
        return self._held + len(self._in_transit) + self._core_waiting

    def reserve(self, n: int) -> Ticket:
        """Hold n slots for requests about to be sent; QueueFullError when they do not fit."""
        with self._lock:
            self._take(n)
        return Ticket(self, n)

    def _take(self, n: int) -> None:
        if self.limit is not None and self._queued() + n > self.limit:
            queued = self._queued()
            what = "a request" if n == 1 else f"{n} requests"
            raise QueueFullError(
                f"the engine's queue is full: {queued} request(s) are admitted but not yet "
                f"running (max_queued_requests={self.limit}), no room for {what}; retry later"
            )
        self._held += n

    def on_frame_sent(self, ticket: Ticket | None) -> None:
        """A frame went to the core; with a ticket, it is an AddRequest using one of its
        slots. Called in send order (under the client's send lock)."""
        with self._lock:
            self._frames_sent += 1
            if ticket is not None:
                ticket.held -= 1
                self._held -= 1
                self._in_transit.append(self._frames_sent)

    def on_report(self, frames_seen: int, num_waiting: int) -> None:
        """An EngineOutputs: the core has read `frames_seen` frames and `num_waiting` wait."""
        with self._lock:
            if frames_seen < self._frames_seen:
                return  # not the latest report (a dying core's last words carry none)
            self._frames_seen = frames_seen
            self._core_waiting = num_waiting
            q = self._in_transit
            while q and q[0] <= frames_seen:
                q.popleft()

    def _grow(self, ticket: Ticket, n: int) -> None:
        with self._lock:
            self._take(n)
            ticket.held += n

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self._held -= ticket.held
            ticket.held = 0

    def census(self) -> dict[str, int]:
        with self._lock:
            return {"admission.held": self._held, "admission.in_transit": len(self._in_transit)}


class Ticket:
    """Slots held for one caller's requests until each is sent; close() gives back the rest
    (a request refused before it was sent, a client gone while its prompt was tokenized)."""

    def __init__(self, bound: QueueBound, n: int) -> None:
        self.bound = bound
        self.held = n

    def grow_to(self, n: int) -> None:
        """Hold n slots in all (a request turned out to have n choices); QueueFullError."""
        if n > self.held:
            self.bound._grow(self, n - self.held)

    def close(self) -> None:
        if self.held:
            self.bound._release(self)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
