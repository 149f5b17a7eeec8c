"""Grammars (structured outputs) as a rank feature (workers/step_hooks.py): the constrained
requests' matchers and bitmasks for the model runner's step, PrepareGrammar / DropGrammars and
their compile tickets for the rank loop.

Always plugged in, and cheap until used: the matchers (and xgrammar) are built on the first
PrepareGrammar or constrained request, and until then each step only looks whether its new
requests carry a constraint.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from protocol.messages import DropGrammars, GrammarReady, PrepareGrammar
from workers.step_hooks import Handler, Reply, StepHook

if TYPE_CHECKING:
    import numpy as np
    import torch

    from protocol.config import EngineConfig
    from protocol.messages import SchedulerOutput
    from workers.runner.batch_inputs import BatchInputs
    from workers.sample.structured import StepMasks, StructuredOutputs


def _no_reply(msg: object) -> None:
    raise RuntimeError("a grammar answer before the rank is connected to the engine core")


class GrammarFeature(StepHook):
    def __init__(self, config: EngineConfig, vocab_size: int, device: torch.device,
                 rank: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.device = device
        self.rank = rank
        self.reply: Reply = _no_reply
        self.structured: StructuredOutputs | None = None  # built on first use
        # the step in flight's bitmask work, from before its forward until its finish (one
        # step is in flight at most between a launch and its finish)
        self.masks: StepMasks | None = None
        # PrepareGrammar tickets still compiling on the grammar pool (no step waits on them):
        # ticket -> (compile, cache key, grammar id)
        self.tickets: dict[int, tuple[Future[Any], tuple[str, str], int]] = {}

    def _make(self) -> StructuredOutputs:
        if self.structured is None:
            from workers.sample.structured import StructuredOutputs

            k = self.config.num_speculative_tokens
            self.structured = StructuredOutputs.for_model(
                self.config.tokenizer or self.config.model, self.vocab_size,
                self.config.max_num_seqs * (1 + k), k, self.device)
        return self.structured

    def cache_bytes(self) -> int:
        return self.structured.cache.size_bytes if self.structured is not None else 0

    # ------------------------------------------------------------------ the rank loop
    def connect(self, results_addr: str, reply: Reply) -> None:
        self.reply = reply

    def messages(self) -> dict[type, Handler]:
        return {PrepareGrammar: self.on_prepare, DropGrammars: self.on_drop}

    def on_prepare(self, msg: PrepareGrammar) -> None:
        """Start compiling a constraint before its request is scheduled; the request's
        NewRequestData later finds it in the grammar cache (entry ``grammar_id``, kept until
        the engine core drops it)."""
        fut = self._make().cache.submit(msg.spec, msg.grammar_id)
        self.tickets[msg.ticket] = (fut, msg.spec.key(), msg.grammar_id)
        self.poll()  # a cached grammar is ready at once

    def poll(self) -> None:
        """Tell the core which of its grammars this rank has compiled (or failed to), with
        what each costs this rank's cache: the core's budget counts it."""
        if not self.tickets:
            return
        from workers.sample.grammar_cache import grammar_bytes  # structured outputs only

        done = [t for t, (f, _, _) in self.tickets.items() if f.done()]
        for ticket in done:
            fut, key, _ = self.tickets.pop(ticket)
            if fut.cancelled():  # the pool closed under it: the rank is going down
                continue
            exc = fut.exception()
            error = "" if exc is None else (str(exc) or type(exc).__name__)
            size = 0 if exc is not None else grammar_bytes(key, fut.result())
            self.reply(GrammarReady(rank=self.rank, ticket=ticket, error=error,
                                    size_bytes=size, cache_bytes=self.cache_bytes()))

    def busy(self) -> bool:
        return bool(self.tickets)

    def on_drop(self, msg: DropGrammars) -> None:
        """The core's eviction, at this point of the broadcast stream on every rank. A ticket
        of a dropped grammar was settled by the core already (timed out, aborted): no answer."""
        if self.structured is not None:
            self.structured.cache.drop(msg.grammar_ids)
        gone = set(msg.grammar_ids)
        for ticket in [t for t, (_, _, g) in self.tickets.items() if g in gone]:
            del self.tickets[ticket]

    # ------------------------------------------------------------------ the step
    def on_launch(self, so: SchedulerOutput) -> None:
        if self.structured is None and any(
                nr.sampling_params.structured_outputs is not None for nr in so.new_reqs):
            self._make()
        if self.structured is not None:
            self.structured.apply_diff(so)

    def before_forward(self, handles: np.ndarray, inputs: BatchInputs) -> None:
        # constrained requests' masks are filled on a helper thread while the forward runs;
        # they need the step before's tokens accepted, which its finish queued before this
        if self.structured is not None:
            self.masks = self.structured.plan(handles, inputs.drafts)

    def masks_logits(self) -> bool:
        return self.masks is not None

    def on_logits(self, logits: torch.Tensor, greedy: bool) -> torch.Tensor | None:
        assert self.structured is not None and self.masks is not None
        if greedy:
            tokens = self.structured.greedy(self.masks, logits)
            if tokens is not None:
                return tokens
        self.structured.apply(self.masks, logits)
        return None

    def after_sampling(self, sampled: np.ndarray, counts: np.ndarray | None,
                       failed: dict[int, str]) -> None:
        if self.structured is None:
            return
        if self.masks is not None:
            self.structured.accept(self.masks, sampled, counts)
            self.masks = None
        self.structured.take_failed(failed)

    # ------------------------------------------------------------------ always
    def census(self, out: dict[str, int]) -> None:
        out["grammar_tickets"] = len(self.tickets)
        structured = self.structured
        if structured is not None:
            out["structured.pending"] = len(structured.pending)
            out["structured.matchers"] = len(structured.matchers)
            out["structured.failed"] = len(structured.failed)
            out["structured.grammar_cache"] = len(structured.cache)

    def close(self) -> None:
        if self.structured is not None:
            self.structured.close()
