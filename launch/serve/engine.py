"""The engine as the HTTP frontend sees it: submit, abort and stats from an asyncio event loop.

The processes are started by launch.llm.LLM, as for the Python API. Outputs still arrive on
EngineClient's one receive thread; here they are handed to the event loop once per engine
message (one call_soon_threadsafe for the whole batch, not one per request), and the loop
routes each output to its request's asyncio.Queue. So there is no thread per request, and a slow
HTTP client only fills its own queue: the receive path never waits for anybody.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from launch.admission import Ticket
from launch.client import Delivery, EngineClient, EngineDeadError
from launch.llm import LLM
from launch.request_options import NO_OPTIONS, RequestOptions
from protocol.messages import EngineCoreOutput as WireOutput
from protocol.messages import HealthReport, SamplingParams

# What a request's queue receives: (choice index, output, engine timestamp).
Event = tuple[int, WireOutput, float]


class LoopSink:
    """Stands in for EngineClient's queue.Queue sink: put() hands a delivery to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, route: Callable[[Delivery], None]):
        self._loop = loop
        self._route = route

    def put(self, delivery: Delivery) -> None:
        try:
            self._loop.call_soon_threadsafe(self._route, delivery)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is waiting
            pass


class AsyncEngine:
    """Submit requests and get their outputs on asyncio queues; one instance per server."""

    def __init__(self, llm: LLM, tokenizer: Any) -> None:
        assert llm.client is not None
        self.llm = llm
        self.client: EngineClient = llm.client
        self.tokenizer = tokenizer
        self.max_model_len = llm.info.max_model_len
        self.vocab_size = llm.info.vocab_size
        self.num_blocks = llm.info.num_blocks
        self.block_size = llm.info.block_size
        self._routes: dict[str, tuple[asyncio.Queue[Event], int]] = {}
        self._sink: LoopSink | None = None
        self._stats_lock: asyncio.Lock | None = None
        self._stats_cache: tuple[float, HealthReport] | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the server's event loop (called from the app's start-up)."""
        self._sink = LoopSink(loop, self._route)
        self._stats_lock = asyncio.Lock()

    # ------------------------------------------------------------------ requests

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        queue: asyncio.Queue[Event],
        index: int,
        options: RequestOptions = NO_OPTIONS,
        ticket: Ticket | None = None,
    ) -> float:
        """Send one request; its outputs go to `queue` tagged with `index`. Returns the
        arrival time (time.time()). Raises EngineDeadError, ValueError for an id in flight, or
        QueueFullError (without a `ticket` holding its slot under the queue bound)."""
        assert self._sink is not None, "attach() first"
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self._routes[request_id] = (queue, index)
        try:
            tr = self.client.add_request(
                request_id,
                prompt_token_ids,
                params,
                self._sink,  # type: ignore[arg-type]  # duck-typed: only put() is called
                index=index,
                options=options,
                ticket=ticket,
            )
        except BaseException:
            self._routes.pop(request_id, None)
            raise
        return tr.arrival_time

    def _route(self, delivery: Delivery) -> None:
        routes = self._routes
        for tr, out, ts in delivery:
            target = routes.get(tr.request_id)
            if target is None:
                continue  # released already (client gone, or a stop string ended it)
            if out.finish_reason is not None:
                del routes[tr.request_id]
            target[0].put_nowait((target[1], out, ts))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort in the engine and forget the routes; late outputs are dropped."""
        ids = [r for r in request_ids if self._routes.pop(r, None) is not None]
        if ids and self.client.dead_reason is None:
            self.client.abort(ids)

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    # ------------------------------------------------------------------ stats

    async def stats(self, max_age_s: float = 0.0, timeout_s: float = 5.0) -> HealthReport:
        """The engine core's health report (running/waiting counts, KV usage, counters).

        The blocking round trip runs in a thread so the event loop keeps serving; concurrent
        callers share one round trip, and a report younger than max_age_s is reused.
        """
        assert self._stats_lock is not None, "attach() first"
        async with self._stats_lock:
            cached = self._stats_cache
            if cached is not None and time.monotonic() - cached[0] <= max_age_s:
                return cached[1]
            if self.client.dead_reason is not None:
                raise EngineDeadError(self.client.dead_reason)
            report = await asyncio.to_thread(self.client.health, timeout_s)
            self._stats_cache = (time.monotonic(), report)
            return report
