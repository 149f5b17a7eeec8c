"""From a step's hidden states to its tokens: greedy, masked (structured outputs), sampled, or
verified against drafts.

Plain steps leave their tokens on the device: the runner copies them to the host on a stream of
its own and the next step's input ids read them there (workers/runner/pending_tokens.py). A step
that verifies drafts needs its tokens' counts on the host before anything else can follow, so it
returns host arrays (workers/sample/spec_decode.py).

The two kinds of outcome carry their own launch and finish (``StepTokens``, ``DraftTokens``), so
the runner's step hands its tokens on without asking which kind it holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.runner.batch_inputs import BatchInputs
from workers.runner.input_batch import InputBatch
from workers.runner.pending_tokens import reserve, resolve
from workers.runner.request_guard import fail_nonfinite_rows
from workers.runner.token_copy import TokenCopy, TokenTransfer
from workers.sample.sampler import GREEDY_EPS, Sampler
from workers.sample.spec_decode import SpecOutput, sample_with_drafts, verify_greedy

if TYPE_CHECKING:
    from workers.model.llama import LlamaForCausalLM
    from workers.step_hooks import StepHook


Finished = tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]  # tokens, counts, logprobs


@dataclass(eq=False)
class StepTokens:
    """A plain step's tokens, still on the device: one per sampling row."""

    tokens: torch.Tensor | None = None  # [S] on the device, sampling order
    logprobs: torch.Tensor | None = None  # [S] float, when any request asked
    nonfinite: torch.Tensor | None = None  # [S] bool: rows with NaN / +inf logits (sampler)
    # the next step may be prepared before this one finishes: its inputs read these tokens
    # on the device (pending_tokens.py)
    overlappable = True

    def launch(self, batch: InputBatch, inputs: BatchInputs, copy: TokenCopy,
               transfer: TokenTransfer) -> torch.Tensor | None:
        """Queue the copy to the host; the device tensor a step prepared meanwhile reads."""
        reserve(batch, inputs)
        host_tokens = self.tokens
        if self.nonfinite is not None and self.tokens is not None:
            # the device keeps a valid placeholder (the next step's inputs read it); the host
            # copy marks the row -1 so finish() fails its request, with no extra sync here
            host_tokens = torch.where(self.nonfinite, -1, self.tokens)
        copy.start(transfer, host_tokens, self.logprobs)
        return self.tokens

    def finish(self, batch: InputBatch, inputs: BatchInputs | None, handles: np.ndarray,
               sampled: np.ndarray | None, logprobs: np.ndarray | None,
               parked: Iterable[int]) -> Finished:
        """The tokens are on the host: write them over the rows' sentinels."""
        assert sampled is not None
        fail_nonfinite_rows(batch, handles, sampled)
        resolve(batch, sampled, parked)
        return sampled, None, logprobs


@dataclass(eq=False)
class DraftTokens:
    """A step that verified drafts: its tokens and per-request counts are on the host."""

    spec: SpecOutput
    # the accepted counts decide the rows' tokens, so nothing may follow before they are on
    # the host: the step is finished before the next is prepared
    overlappable = False

    def launch(self, batch: InputBatch, inputs: BatchInputs, copy: TokenCopy,
               transfer: TokenTransfer) -> torch.Tensor | None:
        copy.ready(transfer, self.spec.token_ids, self.spec.logprobs)
        return None

    def finish(self, batch: InputBatch, inputs: BatchInputs | None, handles: np.ndarray,
               sampled: np.ndarray | None, logprobs: np.ndarray | None,
               parked: Iterable[int]) -> Finished:
        spec = self.spec
        assert inputs is not None
        batch.update_after_step(inputs, spec.token_ids, spec.counts)
        return spec.token_ids, spec.counts, spec.logprobs


def sample_step(model: LlamaForCausalLM, sampler: Sampler, batch: InputBatch,
                inputs: BatchInputs, hidden: torch.Tensor, idx: torch.Tensor,
                logit_hooks: list[StepHook]) -> StepTokens | DraftTokens:
    """The tokens of the rows that sample (``idx``: their logits rows of ``hidden``).

    ``logit_hooks``: the features that edit this step's logits (grammar bitmasks), in order;
    one that picks the greedy tokens itself ends the step's sampling."""
    md = batch.sampling_metadata(inputs.sample_rows)
    drafts = inputs.drafts  # set only when some request verifies drafts this step
    all_greedy = bool((md.temperature <= GREEDY_EPS).all())
    if not logit_hooks and not md.need_logprobs and all_greedy:
        # All greedy: argmax per vocab shard, no full-logit all-gather; drafts only add
        # logits indices.
        targets = model.greedy_tokens(hidden[idx])
        if drafts is None:
            return StepTokens(targets)
        return DraftTokens(verify_greedy(targets, drafts))
    logits = model.compute_logits(hidden[idx])
    if logit_hooks:
        logits = logits.float()
        greedy = drafts is None and not md.need_logprobs and all_greedy
        for hook in logit_hooks:
            tokens = hook.on_logits(logits, greedy)
            if tokens is not None:
                return StepTokens(tokens)
    if drafts is not None:
        return DraftTokens(sample_with_drafts(sampler, logits, drafts, md))
    out = sampler(logits, md)
    return StepTokens(out.token_ids, out.logprobs, nonfinite=out.nonfinite)
