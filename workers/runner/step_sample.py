"""From a step's hidden states to its tokens: greedy, masked (structured outputs), sampled, or
verified against drafts.

Plain steps leave their tokens on the device: the runner copies them to the host on a stream of
its own and the next step's input ids read them there (workers/runner/pending_tokens.py). A step
that verifies drafts needs its tokens' counts on the host before anything else can follow, so it
returns host arrays (workers/sample/spec_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.runner.batch_inputs import BatchInputs
from workers.runner.input_batch import InputBatch
from workers.sample.sampler import GREEDY_EPS, Sampler
from workers.sample.spec_decode import SpecOutput, sample_with_drafts, verify_greedy

if TYPE_CHECKING:
    from workers.model.llama import LlamaForCausalLM
    from workers.step_hooks import StepHook


@dataclass(eq=False)
class StepTokens:
    tokens: torch.Tensor | None = None  # [S] on the device, sampling order (plain steps)
    logprobs: torch.Tensor | None = None  # [S] float, when any request asked
    spec: SpecOutput | None = None  # host arrays (steps that verify drafts)
    nonfinite: torch.Tensor | None = None  # [S] bool: rows with NaN / +inf logits (sampler)


def sample_step(model: LlamaForCausalLM, sampler: Sampler, batch: InputBatch,
                inputs: BatchInputs, hidden: torch.Tensor, idx: torch.Tensor,
                logit_hooks: list[StepHook]) -> StepTokens:
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
        return StepTokens(spec=verify_greedy(targets, drafts))
    logits = model.compute_logits(hidden[idx])
    if logit_hooks:
        logits = logits.float()
        greedy = drafts is None and not md.need_logprobs and all_greedy
        for hook in logit_hooks:
            tokens = hook.on_logits(logits, greedy)
            if tokens is not None:
                return StepTokens(tokens)
    if drafts is not None:
        return StepTokens(spec=sample_with_drafts(sampler, logits, drafts, md))
    out = sampler(logits, md)
    return StepTokens(out.token_ids, out.logprobs, nonfinite=out.nonfinite)
