"""The HTTP side of the bound on waiting requests (--max-queued-requests, launch/admission.py).

A generation route takes one slot before it reads the body, so a full queue is answered at
once (503 with Retry-After) without parsing or tokenizing anything, and the request keeps its
slot while its prompt is tokenized and its grammar compiled: it is admitted, not running.
Generation.submit grows the ticket to one slot per choice and sends each choice on it; the
slots not sent (a 400, a client gone before submit) go back when the route returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import Request

from launch.admission import QueueFullError, Ticket
from launch.serve.context import ServerContext
from launch.serve.errors import overloaded


@contextmanager
def admitted(ctx: ServerContext, request: Request) -> Iterator[Ticket]:
    """Hold one slot for this request while the route runs; 503 when the queue is full."""
    try:
        ticket = ctx.engine.client.admission.reserve(1)
    except QueueFullError as e:
        ctx.metrics.on_refused()
        raise overloaded(str(e)) from None
    request.state.queue_ticket = ticket
    try:
        yield ticket
    finally:
        ticket.close()


def queue_ticket(request: Request) -> Ticket | None:
    """The slot admitted() holds for this request, if the route took one."""
    ticket = getattr(request.state, "queue_ticket", None)
    return ticket if isinstance(ticket, Ticket) else None
