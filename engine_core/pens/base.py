"""The interface every holding pen implements, with no-op defaults.

A pen is asked, in this order over a request's life and the core's loop:
- ``hold(request)``: take it if it must wait here (True), pass it on (False), or refuse it
  (the reason, a str: the request ends with that error);
- ``on_reply(msg)``: a rank's message whose type the pen lists in ``reply_types``; the core
  routes each one by that table, between steps;
- ``tick()``: once per turn of the core's loop, after the replies: time-based decisions and
  anything that finished off the loop (a helper thread, a peer's socket);
- ``abort(request_ids)``: the abort outputs of those held here.

``on_reply`` and ``tick`` answer with a ``Settled``: the requests released (the core offers them
to the pens after this one, then to the scheduler), the final outputs of held requests that
failed, and other answers owed to the frontend. The core never looks inside a pen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import msgspec
import zmq

from protocol.messages import EngineCoreOutput

if TYPE_CHECKING:
    from engine_core.request import Request
    from engine_core.sched.scheduler import Scheduler
    from protocol.messages import WorkerHello

# what an idle core polls besides the frontend and the ranks: a socket or a file descriptor
WakeSource: TypeAlias = "zmq.Socket[bytes] | int"


@dataclass(frozen=True)
class Settled:
    admit: Sequence[Request] = ()  # released: they go on to the next pen or the scheduler
    outputs: Sequence[EngineCoreOutput] = ()  # final outputs of held requests that failed
    notices: Sequence[msgspec.Struct] = ()  # other messages owed to the frontend


NOTHING = Settled()


class HoldingPen:
    """Base class: every role a no-op, so a pen overrides only what its feature needs."""

    name = "pen"
    # rank messages that belong to this pen (routed to ``on_reply``)
    reply_types: tuple[type[msgspec.Struct], ...] = ()
    # frontend control messages that belong to this pen (routed to ``on_control``)
    control_types: tuple[type[msgspec.Struct], ...] = ()

    def start(self, scheduler: Scheduler, hellos: dict[int, WorkerHello]) -> None:
        """The scheduler exists and every rank said hello."""

    def hold(self, request: Request) -> bool | str:
        """True: held here; False: not this pen's, pass it on; a str: refuse it (why)."""
        return False

    def on_reply(self, msg: msgspec.Struct) -> Settled:
        return NOTHING

    def on_control(self, msg: msgspec.Struct) -> msgspec.Struct | None:
        """A frontend control message: its answer now, or None (answered later, a notice)."""
        return None

    def tick(self) -> Settled:
        return NOTHING

    def after_publish(self) -> None:
        """A step went out to the ranks."""

    def abort(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        """Drop the held requests among ``request_ids``; their abort outputs."""
        return []

    @property
    def num_held(self) -> int:
        return 0

    def requests(self) -> Iterable[Request]:
        """The requests held here."""
        return ()

    @property
    def busy(self) -> bool:
        """Waiting on something an idle core must wake for (a rank, a peer, a thread)."""
        return False

    def wake_sources(self) -> Sequence[WakeSource]:
        """What an idle core polls for this pen, besides the frontend and the ranks."""
        return ()

    def census(self) -> dict[str, int]:
        """{map: size} of what this pen keeps (engine_core.census)."""
        return {}

    def stats(self) -> dict[str, float]:
        """Figures for the health report."""
        return {}

    def close(self) -> None:
        pass


def route_table(pens: Iterable[HoldingPen],
                types: Callable[[HoldingPen], Iterable[type[msgspec.Struct]]]
                ) -> dict[type[msgspec.Struct], HoldingPen]:
    """{message type: the pen that owns it}; a type claimed twice is a start-up bug."""
    table: dict[type[msgspec.Struct], HoldingPen] = {}
    for pen in pens:
        for t in types(pen):
            if t in table:
                raise ValueError(f"{t.__name__} is claimed by pens {table[t].name} and {pen.name}")
            table[t] = pen
    return table
