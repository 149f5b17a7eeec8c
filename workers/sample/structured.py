"""Structured outputs on a worker: one grammar matcher per constrained request, on every rank.

Each rank compiles the grammars of its own requests (workers/sample/grammar.py), advances each
matcher with the tokens it sampled itself, and fills the token bitmask locally. All ranks
sample the same tokens, so their matchers and masks stay equal and nothing but the constraint's
text (once, in NewRequestData) crosses the wire.

One step: ``plan`` starts filling the bitmask on a helper thread as soon as the step's inputs
are known (the mask depends only on tokens accepted in earlier steps; xgrammar's fill releases
the GIL, so it runs while the forward does); ``apply`` waits for it and masks the logits in one
op before any sampling (xgrammar's kernel on CUDA; on CPU the engine's C++ kernel, or
xgrammar's CPU path without it); ``accept`` queues the matchers' advance by the emitted tokens
on the same thread, ahead of the next step's fill, so it too overlaps other work. With
drafts, a request's k + 1 logits rows get the masks after each accepted draft: the matcher
accepts the drafts to fill them and then rolls back, and a draft the grammar refuses is masked
out of its own row, so verification rejects it.
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
from workers import cpu_ops
from workers.sample.grammar import hold_until_file, load_tokenizer_info
from workers.sample.grammar_cache import GrammarCache
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
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None
        self.failed: dict[int, str] = {}  # handles whose grammar failed -> reason
        # matcher advances queued on the bitmask thread in this step and in the one before
        self._accepts_now: list[Future[list[tuple[int, xgr.GrammarMatcher, str]]]] = []
        self._accepts_prev: list[Future[list[tuple[int, xgr.GrammarMatcher, str]]]] = []

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
                # the core announced it (PrepareGrammar) and keeps it while the request lives;
                # a key it did not announce is compiled for this request alone, not cached
                self.pending[nr.handle] = self.cache.submit(spec, keep=False)

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
        starts = drafts.row_starts.tolist() if drafts is not None else None
        work: list[tuple[xgr.GrammarMatcher | None, int, list[int]]] = []
        rows: list[int] = []
        spec: list[tuple[int, int]] = []
        matchers, pending = self.matchers, self.pending
        for j, h in enumerate(handles.tolist()):
            m = matchers.get(h)
            if m is None:
                if h not in pending:
                    continue
                m = self._matcher(h)
            spec.append((h, j))
            if starts is None:
                rows.append(j)
                work.append((m, j, []))
                continue
            assert drafts is not None
            k = int(drafts.num_drafts[j])
            s = int(drafts.draft_starts[j])
            first = starts[j]
            rows.extend(range(first, first + k + 1))
            work.append((m, first, drafts.draft_ids[s : s + k].tolist()))
        if not rows:
            return None
        return StepMasks(rows, self._filler.submit(self._fill, work), spec)

    def _fill(self, work: list[tuple[xgr.GrammarMatcher | None, int, list[int]]]) -> None:
        bm = self.bitmask
        # matchers with no drafts to check fill their rows in one call (one crossing into
        # xgrammar instead of one per request)
        batch: list[xgr.GrammarMatcher] = []
        batch_rows: list[int] = []
        for m, first, drafts in work:
            if m is None:  # failed grammar: the request is finished with "error"; no mask
                bm[first : first + len(drafts) + 1] = -1
                continue
            if not drafts and not m.is_terminated():
                batch.append(m)
                batch_rows.append(first)
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
        if batch:
            self._batch.batch_fill_next_token_bitmask(batch, bm, batch_rows)

    @property
    def _batch(self) -> xgr.BatchGrammarMatcher:
        import xgrammar as xgr

        if self._batch_matcher is None:
            # one thread: the fill already runs beside the forward, which has the cores
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        return self._batch_matcher

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
        step.fill.result()
        n = logits.shape[0]
        mask = self.bitmask[:n]
        if cpu_ops.active(logits):
            # xgrammar's CPU path tests every token's bit (10 ms for 64 rows of a 32k
            # vocabulary, more than the step it masks); the kernel writes only refused tokens
            cpu_ops.apply_token_bitmask(logits, mask, torch.tensor(step.rows), self.vocab_size)
            return
        import xgrammar as xgr

        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size,
                                        indices=step.rows)

    def greedy(self, step: StepMasks, logits: torch.Tensor) -> torch.Tensor | None:
        """Argmax tokens of ``logits`` with the constrained rows masked, in one read of the
        logits and no masking pass; None where the CPU kernel is unavailable (then ``apply``
        and the sampler)."""
        if not cpu_ops.active(logits):
            return None
        step.fill.result()
        mask_rows = torch.full((logits.shape[0],), -1, dtype=torch.int64)
        rows = torch.tensor(step.rows)
        mask_rows[rows] = rows
        return cpu_ops.masked_argmax(logits, self.bitmask, mask_rows, self.vocab_size)

    def accept(self, step: StepMasks, tokens: np.ndarray, counts: np.ndarray | None) -> None:
        """Start advancing the matchers by the tokens each request emitted this step
        (``tokens`` flattened in sampling order, ``counts`` per request or None for one each).

        The matchers advance on the bitmask thread, queued before the next step's fill, so the
        grammar work (tens of microseconds a token) overlaps the output, the next schedule and
        the next forward instead of lengthening this step."""
        if counts is None:
            starts = np.arange(len(tokens))
            counts = np.ones(len(tokens), dtype=np.int64)
        else:
            starts = np.cumsum(counts) - counts
        work: list[tuple[int, xgr.GrammarMatcher, list[int]]] = []
        for h, j in step.spec:
            m = self.matchers.get(h)
            if m is not None:
                s = int(starts[j])
                work.append((h, m, tokens[s : s + int(counts[j])].tolist()))
        if work:
            self._accepts_now.append(self._filler.submit(self._accept, work))

    @staticmethod
    def _accept(work: list[tuple[int, xgr.GrammarMatcher, list[int]]]
                ) -> list[tuple[int, xgr.GrammarMatcher, str]]:
        refused = []
        for h, m, tokens in work:
            for t in tokens:
                if m.is_terminated():
                    break
                if not m.accept_token(t):
                    # the mask allowed only grammar tokens, so this is a bug: fail the request
                    # rather than emit unconstrained text
                    refused.append((h, m, f"structured output: token {t} refused by the grammar"))
                    break
        return refused

    def take_failed(self, into: dict[int, str]) -> None:
        """Move this rank's failed requests into ``into``; called once a step.

        A refused token is reported one step after it was sampled: the step before's accepts
        are waited for here (long done: the next fill queued behind them), never this step's,
        so every rank reports the same requests in the same step whatever its threads' timing.
        """
        for fut in self._accepts_prev:
            for h, m, reason in fut.result():
                if self.matchers.get(h) is m:  # not finished meanwhile
                    self.failed[h] = reason
        self._accepts_prev, self._accepts_now = self._accepts_now, []
        if self.failed:
            into.update(self.failed)
            for h in self.failed:
                self.matchers.pop(h, None)
                self.pending.pop(h, None)
            self.failed.clear()

    def close(self) -> None:
        self.cache.close()
        self._filler.shutdown(wait=False, cancel_futures=True)
