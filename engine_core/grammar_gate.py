"""Constrained requests held out of the scheduler until every rank compiled their grammar.

A grammar can take seconds to compile (a large schema, a cold cache). If a worker compiled it
only when the request was scheduled, the first step that samples the request would wait for
it, and with it every other request in that step. So a constrained request is not given to
the scheduler on arrival: the engine core broadcasts its constraint once (PrepareGrammar),
each rank compiles it on its own pool next to whatever steps run, and answers GrammarReady.
Only when every rank is ready does the request enter the scheduler's waiting queue; by then
each rank's grammar cache holds the compiled grammar, so admission costs the step nothing.
A rank that cannot compile it fails only that request.

Unconstrained requests never pass through here: no message, no wait. The cost is one
broadcast and one answer per rank per constrained request, nothing per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from engine_core.request import Request
from protocol.messages import GrammarReady, PrepareGrammar, RequestOutput


@dataclass(eq=False)
class _Held:
    request: Request
    ready: set[int] = field(default_factory=set)  # ranks that compiled the grammar


class GrammarGate:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._tickets = itertools.count()
        self._held: dict[int, _Held] = {}
        self._by_id: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def requests(self) -> Iterator[Request]:
        """The requests held here."""
        return (h.request for h in self._held.values())

    def hold(self, request: Request) -> PrepareGrammar:
        """Hold ``request``; the returned message asks every rank to compile its grammar."""
        spec = request.sampling_params.structured_outputs
        assert spec is not None
        ticket = next(self._tickets)
        self._held[ticket] = _Held(request)
        self._by_id[request.request_id] = ticket
        return PrepareGrammar(ticket, spec)

    def answer(self, msg: GrammarReady) -> Request | RequestOutput | None:
        """A rank's answer: the request to admit once every rank is ready, its error output
        when a rank failed, else None (still waiting, or a ticket already settled/aborted)."""
        held = self._held.get(msg.ticket)
        if held is None:
            return None
        if msg.error:
            self._release(msg.ticket)
            return RequestOutput(
                request_id=held.request.request_id,
                new_token_ids=[],
                finish_reason="error",
                error=f"structured output grammar failed on worker rank {msg.rank}: {msg.error}",
            )
        held.ready.add(msg.rank)
        if len(held.ready) < self.world_size:
            return None
        self._release(msg.ticket)
        return held.request

    def abort(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Drop held requests among ``request_ids``; their abort outputs."""
        outs = []
        for rid in request_ids:
            ticket = self._by_id.get(rid)
            if ticket is not None:
                self._release(ticket)
                outs.append(RequestOutput(request_id=rid, new_token_ids=[], finish_reason="abort"))
        return outs

    def _release(self, ticket: int) -> None:
        held = self._held.pop(ticket)
        del self._by_id[held.request.request_id]
