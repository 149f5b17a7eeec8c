"""Tokens a step has sampled on the device that the host batch does not hold yet.

When a step launches, each row that samples gets its next token's slot at once (num_tokens + 1,
as the scheduler's output placeholder assumes), holding a sentinel: -(i + 1) for the i-th token
of the step's sampled tensor, in sampling order. Token ids are never negative, so a sentinel
cannot be mistaken for a token. It travels with the row's tokens wherever the next diff moves
them (condense; a preemption saves it in the request's output_token_ids), so:

- the next step's inputs gather it like any token, and `fill_input_ids` puts the token itself
  in its place on the device, from the step's sampled tensor, before the host has seen it;
- once the step's tokens are on the host, `resolve` writes them over the sentinels.

A step's sentinels are resolved before the next step launches, so at most one step's exist at a
time and a sentinel's index always refers to the one step in flight.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from workers.runner.batch_inputs import BatchInputs
from workers.runner.block_table import StateMismatchError
from workers.runner.input_batch import InputBatch


def reserve(batch: InputBatch, inputs: BatchInputs) -> None:
    """Advance the scheduled rows as if the step had run, its tokens still unknown."""
    n = len(inputs.sample_rows)
    batch.update_after_step(inputs, -np.arange(1, n + 1, dtype=np.int32))


def resolve(batch: InputBatch, tokens: np.ndarray, parked: Iterable[int]) -> None:
    """Write the step's sampled ``tokens`` (sampling order) over its sentinels: in the rows
    that hold them and in the saved tokens of the requests ``parked`` (preempted) since."""
    n = batch.num_rows
    if n:
        rows = np.arange(n)
        last = batch.num_tokens[:n].astype(np.int64) - 1
        vals = batch.token_ids[rows, last]
        hit = np.flatnonzero(vals < 0)
        if len(hit):
            idx = -vals[hit].astype(np.int64) - 1
            if int(idx.max()) >= len(tokens):
                raise StateMismatchError(
                    f"a pending token refers to sample {int(idx.max())} of a step that "
                    f"sampled {len(tokens)}")
            batch.token_ids[rows[hit], last[hit]] = tokens[idx]
    for h in parked:
        st = batch.states.get(h)
        if st is None or st.row >= 0 or not st.output_token_ids:
            continue
        v = st.output_token_ids[-1]
        if v < 0:
            st.output_token_ids[-1] = int(tokens[-v - 1])


def pending_span(inputs: BatchInputs) -> int:
    """How many of the in-flight step's tokens the inputs need at least (0: none pending)."""
    if not len(inputs.input_ids):
        return 0
    return max(0, -int(inputs.input_ids.min()))


def fill_input_ids(input_ids: torch.Tensor, sampled: torch.Tensor | None, span: int) -> None:
    """Replace the sentinels in ``input_ids`` (on the device, in place) by the tokens of
    ``sampled``, the in-flight step's sampled tensor, without a host round trip; ``span`` is
    pending_span of the inputs."""
    if sampled is None or len(sampled) < span:
        raise StateMismatchError(
            f"the inputs hold tokens pending from a step in flight that sampled "
            f"{0 if sampled is None else len(sampled)} (need {span})")
    src = input_ids.neg().sub_(1).clamp_(min=0)
    picked = sampled.to(input_ids.dtype).index_select(0, src)
    input_ids.copy_(torch.where(input_ids < 0, picked, input_ids))
