"""The frontend's side of structured outputs: refuse a constraint that does not compile, before
anything is queued, and make the grammar's end a stop.

The frontend compiles each constraint with the same xgrammar code the workers run (cached by
key, on a thread pool), so a bad schema, regex or grammar is a clear ValueError (a 400 over
HTTP) and never reaches the engine, and a request is only sent once its grammar compiled. The
workers compile it again for themselves (their own cache), each next to its forward pass.

A matcher that reaches the grammar's end allows only the tokenizer's end-of-sequence token;
that token is added to the request's stop_token_ids, so the request finishes with "stop" even
when the model's own eos differs (a dummy model with a real tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec

from protocol.messages import SamplingParams
from protocol.structured import StructuredOutputsParams, structured_error
from workers.sample.grammar import GrammarCache, tokenizer_info

__all__ = ["FrontendGrammars", "StructuredOutputsParams"]


class FrontendGrammars:
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.cache: GrammarCache | None = None
        if tokenizer is not None:
            self.cache = GrammarCache(lambda: tokenizer_info(tokenizer, vocab_size))

    def submit(self, sp: SamplingParams) -> Future[Any]:
        """Start compiling ``sp``'s constraint; ValueError at once for a malformed one."""
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
        return self.cache.submit(spec)

    def finish(self, sp: SamplingParams, compiled: Future[Any]) -> SamplingParams:
        """Wait for the compile (GrammarError is a ValueError naming the problem); the params
        to send, with the tokenizer's eos as a stop token."""
        compiled.result()
        eos = self.tokenizer.eos_token_id
        if eos is None or eos in sp.stop_token_ids:
            return sp
        return msgspec.structs.replace(sp, stop_token_ids=[*sp.stop_token_ids, eos])

    def prepare(self, params: Sequence[SamplingParams]) -> list[SamplingParams]:
        """Every constrained params compiled (concurrently) and ready to send."""
        futures = {id(sp): self.submit(sp) for sp in params if sp.structured_outputs is not None}
        return [self.finish(sp, futures[id(sp)]) if id(sp) in futures else sp for sp in params]

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()

