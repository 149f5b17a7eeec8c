"""Compiled grammars by constraint key: compiled on a small pool, kept within a byte budget.

One cache per process: the frontend's (to refuse a bad or slow constraint before anything is
queued) and one on every worker rank. A hostile client sending a new schema per request must
not grow any of them without end, so every entry is counted in bytes (xgrammar's own count of
the compiled grammar, plus the key's text: a schema can be large) and xgrammar's own compiler
cache is off: this is the only copy.

Who evicts:
- the frontend (``limit_bytes`` set): least recently used entries that no request holds
  (``acquire`` .. ``GrammarHold.release``) leave once the entries pass the budget. A compile
  whose every holder gave up (its timeout passed) is cancelled if still queued, and its result
  is not kept if it was running.
- a worker rank (``limit_bytes`` None): only the engine core decides, by grammar id
  (``PrepareGrammar.grammar_id`` in, ``drop`` for DropGrammars out), so every rank holds the
  same grammars after the same messages, and never drops one a live request still needs.

Compiling runs on daemon threads (workers/sample/compile_pool.py), two of them: compilation is
CPU work that competes with the forward, and the second core stays free. Importing xgrammar
(seconds: it pulls in transformers) and building the token table happen there too.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.structured import StructuredOutputsParams
from workers.sample.compile_pool import CompilePool
from workers.sample.grammar import compile_constraint

if TYPE_CHECKING:
    import xgrammar as xgr

COMPILE_THREADS = 2
# the Python side of one entry (entry, future, dict slot, key tuple), beyond the two counted
ENTRY_OVERHEAD_BYTES = 1024

Key = tuple[str, str]


def grammar_bytes(key: Key, compiled: xgr.CompiledGrammar) -> int:
    """What one cached grammar costs: xgrammar's count, the key's text, the Python objects."""
    return int(compiled.memory_size_bytes) + len(key[1]) + ENTRY_OVERHEAD_BYTES


def compile_timeout_error(timeout_s: float, started: bool) -> str:
    """The message of a request whose constraint took longer than the limit to compile."""
    where = "" if started else "; it was still queued behind other compiles"
    return (f"structured output grammar did not compile within {timeout_s:g} s "
            f"(--structured-outputs-compile-timeout){where}")


@dataclass(eq=False)
class _Entry:
    key: Key
    future: Future[Any]
    holders: int = 0
    size: int = 0  # bytes once compiled; 0 while compiling
    grammar_id: int | None = None  # the engine core's name for it (worker ranks)


class GrammarHold:
    """A request's claim on a cache entry: not evicted (nor its compile cancelled) until
    released. ``release`` may be called more than once."""

    def __init__(self, cache: GrammarCache, entry: _Entry) -> None:
        self.future: Future[xgr.CompiledGrammar] = entry.future
        self._cache: GrammarCache | None = cache
        self._entry = entry

    def release(self) -> None:
        if self._cache is not None:
            self._cache._release(self._entry)
            self._cache = None


class GrammarCache:
    def __init__(self, info_factory: Any, before_compile: Any = None,
                 limit_bytes: int | None = None) -> None:
        self._info_factory = info_factory  # () -> xgr.TokenizerInfo
        self._before_compile = before_compile  # () -> None: a test's slow compile, else None
        self.limit_bytes = limit_bytes
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()  # guards the entries; held only for dict work
        self._compiler_lock = threading.Lock()  # held while the token table is built
        self._pool = CompilePool(COMPILE_THREADS, "grammar")
        self._entries: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self._ids: dict[int, Key] = {}
        self._bytes = 0
        self.evictions = 0
        # when the compiler (xgrammar imported, token table built) became ready: a request's
        # compile time limit counts from then at the earliest, not through that one-time load
        self.ready_at: float | None = None

    # ------------------------------------------------------------------ use

    def acquire(self, spec: StructuredOutputsParams) -> GrammarHold:
        """The compiled grammar of ``spec``, now or later, held until the hold is released."""
        entry, new = self._entry(spec, keep=True, hold=True)
        if new:
            self._watch(entry)
        return GrammarHold(self, entry)

    def submit(self, spec: StructuredOutputsParams, grammar_id: int | None = None,
               keep: bool = True) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``spec``, now or later, not held. ``keep=False``: a key not
        cached is compiled for this caller alone (a rank keeps only what the core announced)."""
        entry, new = self._entry(spec, keep, hold=False, grammar_id=grammar_id)
        if new and keep:
            self._watch(entry)
        return entry.future

    def drop(self, grammar_ids: list[int]) -> None:
        """Forget these entries (the engine core's eviction); a queued compile is cancelled."""
        gone = []
        with self._lock:
            for gid in grammar_ids:
                key = self._ids.get(gid)
                entry = self._entries.get(key) if key is not None else None
                if entry is not None and entry.grammar_id == gid:
                    self._remove(entry)
                    gone.append(entry.future)
                else:
                    self._ids.pop(gid, None)
        _cancel(gone)

    @property
    def size_bytes(self) -> int:
        """Bytes of the compiled grammars kept (compiles in progress count once done)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ inside

    def _entry(self, spec: StructuredOutputsParams, keep: bool, hold: bool,
               grammar_id: int | None = None) -> tuple[_Entry, bool]:
        key = spec.key()
        with self._lock:
            entry = self._entries.get(key)
            new = entry is None
            if entry is not None:
                self._entries.move_to_end(key)
            else:
                entry = _Entry(key, self._pool.submit(lambda: self._compile(spec)))
                if keep:
                    self._entries[key] = entry
            if grammar_id is not None and keep:
                entry.grammar_id = grammar_id
                self._ids[grammar_id] = key
            if hold:
                entry.holders += 1
        return entry, new

    def _watch(self, entry: _Entry) -> None:
        # the callback names the entry by key and future, never the entry itself: a future
        # keeps its callbacks after it ran, and a cycle future -> callback -> entry -> future
        # would leave each evicted grammar to the cyclic GC, which in a process with many
        # long-lived objects (torch imported) runs rarely: memory grew as if nothing left
        key = entry.key
        entry.future.add_done_callback(lambda fut: self._settled(key, fut))

    def _settled(self, key: Key, fut: Future[Any]) -> None:
        """A compile ended: count it, or forget it if it failed; then keep to the budget."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.future is not fut:
                return  # dropped or given up meanwhile: the result is not kept
            if fut.cancelled() or fut.exception() is not None:
                self._remove(entry)  # a failure is not cached: the next request retries
                return
            entry.size = grammar_bytes(entry.key, fut.result())
            self._bytes += entry.size
            self._evict()

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.holders -= 1
            if entry.holders or self._entries.get(entry.key) is not entry:
                return
            if entry.future.done():
                self._evict()
                return
            self._remove(entry)  # every holder gave up on it: cancelled or not kept
        _cancel([entry.future])

    def _evict(self) -> None:
        """Least recently used entries nobody holds leave until the rest fits the budget."""
        if self.limit_bytes is None or self._bytes <= self.limit_bytes:
            return
        over = self._bytes - self.limit_bytes
        victims = []
        for entry in self._entries.values():
            if over <= 0:
                break
            if not entry.holders and entry.size:
                victims.append(entry)
                over -= entry.size
        for entry in victims:
            self._remove(entry)
        self.evictions += len(victims)

    def _remove(self, entry: _Entry) -> None:
        del self._entries[entry.key]
        self._bytes -= entry.size
        if entry.grammar_id is not None and self._ids.get(entry.grammar_id) == entry.key:
            del self._ids[entry.grammar_id]

    def compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                # the compiler's own threads: one, the pool gives the parallelism; its own
                # cache off: it would keep every grammar ever compiled, this cache is bounded
                self._compiler = xgr.GrammarCompiler(self._info_factory(), max_threads=1,
                                                     cache_enabled=False)
                self.ready_at = time.monotonic()
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if self._before_compile is not None:
            self._before_compile()
        return compile_constraint(self.compiler(), spec)

    def close(self) -> None:
        self._pool.close()


def _cancel(futures: list[Future[Any]]) -> None:
    """Cancel compiles still queued (a running one cannot be stopped). Outside the cache's
    lock: a cancelled future runs its callbacks at once, and they take that lock."""
    for fut in futures:
        fut.cancel()
