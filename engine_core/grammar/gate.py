"""Constrained requests held out of the scheduler until every rank compiled their grammar, and
the one place that decides which compiled grammars the ranks keep.

A grammar can take seconds to compile (a large schema, a cold cache). If a worker compiled it
only when the request was scheduled, the first step that samples the request would wait for
it, and with it every other request in that step. So a constrained request is not given to
the scheduler on arrival: the engine core broadcasts its constraint once (PrepareGrammar),
each rank compiles it on its own pool next to whatever steps run, and answers GrammarReady.
Only when every rank is ready does the request enter the scheduler's waiting queue; by then
each rank's grammar cache holds the compiled grammar, so admission costs the step nothing.
A rank that cannot compile it fails only that request.

Compile time limit: a ticket not answered by every rank within
``structured_outputs_compile_timeout`` seconds of its arrival (queueing on the ranks' pools
included) fails its request with an error naming the limit. The decision is taken here, once,
so the ranks cannot disagree about it; a rank's later answer to a settled ticket is ignored,
and the grammar is dropped on every rank (a queued compile is cancelled). Loading the grammar
engine (xgrammar's import, the token table: seconds, once per rank) is not a compile: tickets
held before every rank answered its first one get their time from that moment.

Cache budget: every rank keeps the same compiled grammars, chosen here. Each constraint key
gets a grammar id while it is cached; its holders are the requests that use it (held here, or
admitted and not yet finished: their matchers live on every rank), and its size is what the
ranks report in GrammarReady. When the grammars pass ``structured_outputs_cache_mb``, the least
recently used ones nobody holds are dropped; a grammar nobody holds that never compiled on every
rank (failed, timed out, aborted) is dropped at once. Drops go out as one DropGrammars broadcast,
ordered with PrepareGrammar and the steps, so every rank applies the same evictions at the same
point. Finished requests are noticed lazily (their status), when the budget is exceeded or the
list of admitted requests has doubled, so nothing here runs per step.

Unconstrained requests never pass through here: no message, no wait. The cost is one
broadcast and one answer per rank per constrained request, nothing per step but ``expire``'s
look at the oldest deadline.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec

from engine_core.request import Request, RequestStatus
from protocol.config import EngineConfig
from protocol.messages import DropGrammars, EngineCoreOutput, GrammarReady, PrepareGrammar

Key = tuple[str, str]


@dataclass(eq=False)
class _Grammar:
    grammar_id: int
    key: Key
    holders: int = 0  # held tickets + admitted requests not known to be finished
    size: int | None = None  # bytes on a rank, once every rank compiled it


@dataclass(eq=False)
class _Held:
    request: Request
    grammar: _Grammar
    ready: set[int] = field(default_factory=set)  # ranks that compiled the grammar
    size: int = 0  # the largest size a rank reported


class GrammarGate:
    def __init__(self, world_size: int, config: EngineConfig | None = None,
                 publish: Callable[[msgspec.Struct], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config = config or EngineConfig()
        self.world_size = world_size
        self.cache_bytes = config.structured_outputs_cache_mb * 2**20
        self.timeout_s = config.structured_outputs_compile_timeout
        self._publish = publish  # sends a broadcast to every rank (DropGrammars)
        self._clock = clock
        self._tickets = itertools.count()
        self._held: dict[int, _Held] = {}
        self._by_id: dict[str, int] = {}
        self._deadlines: deque[tuple[float, int]] = deque()  # (deadline, ticket), in order
        self._warm: set[int] = set()  # ranks that answered a ticket: their compiler is loaded
        self._cold: list[int] = []  # tickets held before every rank was warm: no deadline yet
        self._ids = itertools.count()
        self._grammars: OrderedDict[Key, _Grammar] = OrderedDict()  # least recently used first
        self._bytes = 0  # sizes of the grammars every rank compiled
        self._admitted: list[tuple[Request, _Grammar]] = []
        self._unheld_unsized: list[_Grammar] = []  # released before every rank compiled them
        self._reap_at = 64
        self.evictions = 0  # grammars dropped for the budget
        self.timeouts = 0
        self.rank_cache_bytes_max = [0] * world_size  # the largest cache a rank reported

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
        key = spec.key()
        g = self._grammars.get(key)
        if g is None:
            g = self._grammars[key] = _Grammar(next(self._ids), key)
        else:
            self._grammars.move_to_end(key)
        g.holders += 1
        ticket = next(self._tickets)
        self._held[ticket] = _Held(request, g)
        self._by_id[request.request_id] = ticket
        if len(self._warm) < self.world_size:
            self._cold.append(ticket)
        else:
            self._deadlines.append((self._clock() + self.timeout_s, ticket))
        if len(self._admitted) > self._reap_at:
            self._reap()
        # grammars released since the last decision leave before this one compiles
        self._evict()
        return PrepareGrammar(ticket, spec, g.grammar_id)

    def answer(self, msg: GrammarReady) -> Request | EngineCoreOutput | None:
        """A rank's answer: the request to admit once every rank is ready, its error output
        when a rank failed, else None (still waiting, or a ticket already settled/aborted)."""
        if 0 <= msg.rank < self.world_size:
            worst = self.rank_cache_bytes_max
            worst[msg.rank] = max(worst[msg.rank], msg.cache_bytes)
            if msg.rank not in self._warm:
                self._warm.add(msg.rank)
                if len(self._warm) == self.world_size:  # every compiler loaded: clocks start
                    deadline = self._clock() + self.timeout_s
                    self._deadlines.extend((deadline, t) for t in self._cold)
                    self._cold.clear()
        held = self._held.get(msg.ticket)
        if held is None:
            return None
        if msg.error:
            self._settle(msg.ticket)
            return _error(held, f"structured output grammar failed on worker rank "
                                f"{msg.rank}: {msg.error}")
        held.ready.add(msg.rank)
        held.size = max(held.size, msg.size_bytes)
        if len(held.ready) < self.world_size:
            return None
        self._release(msg.ticket)
        g = held.grammar
        if g.size is None:
            g.size = held.size
            self._bytes += g.size
        self._admitted.append((held.request, g))  # holds g until the request finishes
        self._evict()
        return held.request

    def expire(self) -> list[EngineCoreOutput]:
        """Fail the held requests whose grammar missed the compile time limit; call it from
        the core loop (cheap: a look at the oldest deadline)."""
        now = self._clock()
        outs = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, ticket = self._deadlines.popleft()
            held = self._held.get(ticket)
            if held is None:
                continue  # settled before its deadline
            missing = sorted(set(range(self.world_size)) - held.ready)
            self._settle(ticket, evict=False)
            self.timeouts += 1
            outs.append(_error(
                held, f"structured output grammar did not compile within {self.timeout_s:g} s "
                      f"(--structured-outputs-compile-timeout) on worker ranks {missing}"))
        if outs:
            self._evict()
        return outs

    def abort(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Drop held requests among ``request_ids``; their abort outputs."""
        outs = []
        for rid in request_ids:
            ticket = self._by_id.get(rid)
            if ticket is not None:
                self._settle(ticket, evict=False)
                outs.append(EngineCoreOutput(request_id=rid, new_token_ids=[],
                                             finish_reason="abort"))
        if outs:
            self._evict()
        return outs

    def stats(self) -> dict[str, float]:
        """Figures for the health report: the cache the ranks keep, as decided here."""
        out = {"grammar_cache_bytes": float(self._bytes),
               "grammar_cache_grammars": float(len(self._grammars)),
               "grammar_cache_evictions": float(self.evictions),
               "grammar_compile_timeouts": float(self.timeouts)}
        for rank, worst in enumerate(self.rank_cache_bytes_max):
            out[f"grammar_cache_bytes_max_rank{rank}"] = float(worst)
        return out

    # ------------------------------------------------------------------ inside

    def _release(self, ticket: int) -> _Held:
        held = self._held.pop(ticket)
        del self._by_id[held.request.request_id]
        return held

    def _settle(self, ticket: int, evict: bool = True) -> None:
        """The ticket ends without admission: its grammar loses a holder."""
        g = self._release(ticket).grammar
        g.holders -= 1
        if not g.holders and g.size is None:
            self._unheld_unsized.append(g)
        if evict:
            self._evict()

    def _reap(self) -> None:
        """Admitted requests that finished no longer hold their grammar."""
        live = []
        for req, g in self._admitted:
            if RequestStatus.is_finished(req.status):
                g.holders -= 1
            else:
                live.append((req, g))
        self._admitted = live
        self._reap_at = max(64, 2 * len(live))

    def _evict(self) -> None:
        # nobody holds them and they never compiled on every rank: nothing worth keeping
        drop = [g for g in self._unheld_unsized if not g.holders and g.size is None
                and self._grammars.get(g.key) is g]
        self._unheld_unsized.clear()
        if self._bytes > self.cache_bytes:
            self._reap()
            over = self._bytes - self.cache_bytes
            for g in self._grammars.values():  # least recently used first
                if over <= 0:
                    break
                if not g.holders and g.size is not None:
                    drop.append(g)
                    over -= g.size
                    self.evictions += 1
        if not drop:
            return
        for g in drop:
            del self._grammars[g.key]
            self._bytes -= g.size or 0
        if self._publish is not None:
            self._publish(DropGrammars([g.grammar_id for g in drop]))


def _error(held: _Held, reason: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=held.request.request_id, new_token_ids=[],
                         finish_reason="error", error=reason)
