"""Structured outputs on a worker: one grammar matcher per constrained request, on every rank.

Each rank compiles the grammars of its own requests (workers/sample/grammar.py), advances each
matcher with the tokens it sampled itself, and fills the token bitmask locally. All ranks
sample the same tokens, so their matchers and masks stay equal and nothing but the constraint's
text (once, in NewRequestData) crosses the wire.

One step: ``plan`` starts filling the bitmask on a helper thread as soon as the step's inputs
are known (the mask depends only on tokens accepted in earlier steps; xgrammar's fill releases
the GIL, so it runs while the forward does); ``apply`` waits for it and masks the logits in one
op (xgrammar's kernel on CUDA, its CPU path on CPU) before any sampling; ``accept`` advances the
matchers by the emitted tokens. With drafts, a request's k + 1 logits rows get the masks after
each accepted draft: the matcher accepts the drafts to fill them and then rolls back, and a
draft the grammar refuses is masked out of its own row, so verification rejects it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.codec import unpack
from protocol.messages import SchedulerOutput
from protocol.structured import StructuredOutputsParams
from workers.sample.grammar import GrammarCache, hold_until_file, load_tokenizer_info
from workers.sample.spec_decode import DraftLayout

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# The engine core admits a constrained request only once every rank answered PrepareGrammar,
# so its grammar is in this rank's cache when it first samples; the wait is a safety net for a
# request that reached the workers some other way (it is then this rank's own compile).
COMPILE_WAIT_S = 60.0


@dataclass(eq=False)
class StepMasks:
    """The bitmask work of one step: which logits rows are constrained, filled in the back."""

    rows: list[int]  # logits rows to mask
    fill: Future[None]
    spec: list[tuple[int, int]]  # (handle, number of emitted tokens' logits rows) per request


class StructuredOutputs:
    def __init__(self, info_factory: Callable[[], xgr.TokenizerInfo], vocab_size: int,
                 max_rows: int, max_drafts: int, device: torch.device,
                 before_compile: Callable[[], None] | None = None) -> None:
        self.cache = GrammarCache(info_factory, before_compile)
        self.vocab_size = vocab_size
        self.device = device
        self.max_drafts = max_drafts
        self.pending: dict[int, Future[xgr.CompiledGrammar]] = {}
        self.matchers: dict[int, xgr.GrammarMatcher] = {}
        # xgrammar's layout (allocate_token_bitmask): 32 tokens per int32, -1 = all allowed;
        # made here so xgrammar itself is first imported on the compile pool, not in a step
        self.bitmask = torch.full((max_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)
        if device.type == "cuda":
            self.bitmask = self.bitmask.pin_memory()
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="bitmask")
        self.failed: dict[int, str] = {}  # handles whose grammar failed -> reason

    @classmethod
    def for_model(cls, tokenizer_source: str, vocab_size: int, max_rows: int, max_drafts: int,
                  device: torch.device) -> StructuredOutputs:
        hold = os.environ.get("TANDEM_TEST_GRAMMAR_HOLD")  # unset in real use
        return cls(lambda: load_tokenizer_info(tokenizer_source, vocab_size), vocab_size,
                   max_rows, max_drafts, device,
                   (lambda: hold_until_file(hold)) if hold else None)

    # ------------------------------------------------------------------ requests

    def apply_diff(self, so: SchedulerOutput) -> None:
        """Start compiling new requests' grammars; forget finished ones."""
        if (self.pending or self.matchers) and so.finished_handles:
            for h in unpack(so.finished_handles):
                self.pending.pop(h, None)
                self.matchers.pop(h, None)
        for nr in so.new_reqs:
            spec: StructuredOutputsParams | None = nr.sampling_params.structured_outputs
            if spec is not None:
                self.pending[nr.handle] = self.cache.submit(spec)

    def is_constrained(self, handle: int) -> bool:
        return handle in self.matchers or handle in self.pending

    def _matcher(self, handle: int) -> xgr.GrammarMatcher | None:
        m = self.matchers.get(handle)
        if m is not None:
            return m
        fut = self.pending.pop(handle)
        try:
            grammar = fut.result(timeout=COMPILE_WAIT_S)
        except Exception as e:  # noqa: BLE001 - this request's failure, not the rank's
            self.failed[handle] = f"structured output grammar failed: {e}"
            return None
        import xgrammar as xgr  # loaded by the compile that just finished

        m = xgr.GrammarMatcher(grammar, max_rollback_tokens=self.max_drafts)
        self.matchers[handle] = m
        return m

    # ------------------------------------------------------------------ one step

    def plan(self, handles: np.ndarray, drafts: DraftLayout | None) -> StepMasks | None:
        """Start filling the masks of this step's sampling requests (``handles`` in sampling
        order); None when none of them is constrained."""
        if not (self.matchers or self.pending):
            return None
        starts = drafts.row_starts if drafts is not None else np.arange(len(handles))
        work: list[tuple[xgr.GrammarMatcher | None, int, list[int]]] = []
        rows: list[int] = []
        spec: list[tuple[int, int]] = []
        for j, h in enumerate(handles.tolist()):
            if not self.is_constrained(h):
                continue
            m = self._matcher(h)
            k = 0
            ids: list[int] = []
            if drafts is not None:
                k = int(drafts.num_drafts[j])
                s = int(drafts.draft_starts[j])
                ids = drafts.draft_ids[s : s + k].tolist()
            first = int(starts[j])
            rows.extend(range(first, first + k + 1))
            spec.append((h, j))
            work.append((m, first, ids))
        if not rows:
            return None
        return StepMasks(rows, self._filler.submit(self._fill, work), spec)

    def _fill(self, work: list[tuple[xgr.GrammarMatcher | None, int, list[int]]]) -> None:
        bm = self.bitmask
        for m, first, drafts in work:
            if m is None:  # failed grammar: the request is finished with "error"; no mask
                bm[first : first + len(drafts) + 1] = -1
                continue
            accepted = 0
            for i in range(len(drafts) + 1):
                if accepted < i:  # an earlier draft was refused: these rows are never used
                    bm[first + i] = -1
                    continue
                self._fill_row(m, first + i)
                if i < len(drafts) and not m.is_terminated() and m.accept_token(drafts[i]):
                    accepted += 1
            if accepted:
                m.rollback(accepted)

    def _fill_row(self, m: xgr.GrammarMatcher, row: int) -> None:
        if m.is_terminated():
            # past the grammar's end (min_tokens or ignore_eos kept it going): stop tokens only
            self.bitmask[row] = 0
            for t in m.stop_token_ids:
                self.bitmask[row, t // 32] |= 1 << (t % 32)
        else:
            m.fill_next_token_bitmask(self.bitmask, row)

    def apply(self, step: StepMasks, logits: torch.Tensor) -> None:
        """Mask the constrained rows of ``logits`` (float32) in place, in one op."""
        import xgrammar as xgr

        step.fill.result()
        n = logits.shape[0]
        mask = self.bitmask[:n]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size,
                                        indices=step.rows)

    def accept(self, step: StepMasks, tokens: np.ndarray, counts: np.ndarray | None) -> None:
        """Advance the matchers by the tokens each request emitted this step (``tokens``
        flattened in sampling order, ``counts`` per request or None for one each)."""
        if counts is None:
            starts = np.arange(len(tokens))
            counts = np.ones(len(tokens), dtype=np.int64)
        else:
            starts = np.cumsum(counts) - counts
        for h, j in step.spec:
            m = self.matchers.get(h)
            if m is None:
                continue
            s = int(starts[j])
            for t in tokens[s : s + int(counts[j])].tolist():
                if m.is_terminated():
                    break
                if not m.accept_token(t):
                    # the mask allowed only grammar tokens, so this is a bug: fail the request
                    # (every rank does the same) rather than emit unconstrained text
                    self.failed[h] = f"structured output: token {t} refused by the grammar"
                    break

    def take_failed(self, into: dict[int, str]) -> None:
        if self.failed:
            into.update(self.failed)
            for h in self.failed:
                self.matchers.pop(h, None)
                self.pending.pop(h, None)
            self.failed.clear()

    def close(self) -> None:
        self.cache.close()
        self._filler.shutdown(wait=False, cancel_futures=True)
