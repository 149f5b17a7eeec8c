"""The frontend's side of structured outputs: refuse a constraint that does not compile, before
anything is queued, and make the grammar's end a stop.

The frontend compiles each constraint with the same xgrammar code the workers run (cached by
key, on a thread pool), so a bad schema, regex or grammar is a clear ValueError (a 400 over
HTTP) and never reaches the engine, and a request is only sent once its grammar compiled. The
workers compile it again for themselves (their own cache), each next to its forward pass.

Both limits of EngineConfig apply here first: the cache keeps at most
``structured_outputs_cache_mb`` of compiled grammars (a request holds its entry only while it
waits for the compile), and a constraint that has not compiled within
``structured_outputs_compile_timeout`` seconds of its submission, queueing included, is a
ValueError naming the limit; the compile is cancelled if it never started, and its result is
not kept if it did. So a pathological schema never reaches the ranks, and a flood of slow ones
holds a simple one back at most that long.

A matcher that reaches the grammar's end allows only the tokenizer's end-of-sequence token;
that token is added to the request's stop_token_ids, so the request finishes with "stop" even
when the model's own eos differs (a dummy model with a real tokenizer).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import msgspec

from protocol.config import EngineConfig
from protocol.messages import SamplingParams
from protocol.structured import StructuredOutputsParams, structured_error
from workers.sample.grammar import tokenizer_info
from workers.sample.grammar_cache import GrammarCache, GrammarHold, compile_timeout_error

__all__ = ["FrontendGrammars", "PendingGrammar", "StructuredOutputsParams"]


class PendingGrammar:
    """One request's compile: its claim on the cache entry and the time it has left.

    The limit counts from the submission, or from when the compiler became ready if that was
    later: loading the grammar engine once (importing xgrammar, building the token table) is
    not the constraint's compile time."""

    def __init__(self, hold: GrammarHold, cache: GrammarCache, timeout_s: float) -> None:
        self.hold = hold
        self.future: Future[Any] = hold.future
        self._cache = cache
        self._submitted = time.monotonic()
        self._timeout_s = timeout_s

    def remaining(self) -> float:
        ready = self._cache.ready_at
        if ready is None:  # the compiler is still loading: the clock has not started
            return self._timeout_s
        return max(0.0, max(self._submitted, ready) + self._timeout_s - time.monotonic())

    def wait(self) -> None:
        """Until the compile ended; ValueError naming the limit if it ran out first."""
        while True:
            try:
                self.future.result(timeout=self.remaining())
                return
            except FutureTimeout:
                if self.remaining() > 0:
                    continue  # the clock started late (the compiler was loading)
                started = self.future.running() or self.future.done()
                raise ValueError(compile_timeout_error(self._timeout_s, started)) from None


class FrontendGrammars:
    def __init__(self, tokenizer: Any, vocab_size: int, config: EngineConfig | None = None,
                 before_compile: Callable[[], None] | None = None) -> None:
        config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.timeout_s = config.structured_outputs_compile_timeout
        self.cache: GrammarCache | None = None
        if tokenizer is not None:
            self.cache = GrammarCache(lambda: tokenizer_info(tokenizer, vocab_size),
                                      before_compile,
                                      limit_bytes=config.structured_outputs_cache_mb * 2**20)

    def submit(self, sp: SamplingParams) -> PendingGrammar:
        """Start compiling ``sp``'s constraint; ValueError at once for a malformed one. The
        caller passes the result to ``finish`` (or releases ``.hold`` if it gives up first)."""
        spec = sp.structured_outputs
        assert spec is not None
        reason = structured_error(spec)
        if reason is not None:
            raise ValueError(reason)
        if self.cache is None:
            raise ValueError(
                "structured outputs need a tokenizer: this model has none "
                "(pass tokenizer=... / --tokenizer with a tokenizer directory or .gguf file)"
            )
        return PendingGrammar(self.cache.acquire(spec), self.cache, self.timeout_s)

    def finish(self, sp: SamplingParams, pending: PendingGrammar) -> SamplingParams:
        """Wait for the compile until its deadline (GrammarError, a ValueError, names the
        problem; so does the ValueError of a compile past the limit); the params to send, with
        the tokenizer's eos as a stop token. Releases the request's hold in every case."""
        try:
            pending.wait()
        finally:
            pending.hold.release()
        eos = self.tokenizer.eos_token_id
        if eos is None or eos in sp.stop_token_ids:
            return sp
        return msgspec.structs.replace(sp, stop_token_ids=[*sp.stop_token_ids, eos])

    def prepare(self, params: Sequence[SamplingParams]) -> list[SamplingParams]:
        """Every constrained params compiled (concurrently) and ready to send."""
        pending: dict[int, PendingGrammar] = {}
        try:
            for sp in params:
                if sp.structured_outputs is not None:
                    pending[id(sp)] = self.submit(sp)
            return [self.finish(sp, pending[id(sp)]) if id(sp) in pending else sp
                    for sp in params]
        finally:  # one failure must not leave the others' entries held forever
            for p in pending.values():
                p.hold.release()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

