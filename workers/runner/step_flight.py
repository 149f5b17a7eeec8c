"""The two halves of a step between the model runner's phases: prepared (diff applied, inputs
built and staged) and in flight (launched on the device, tokens on their way to the host)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol.messages import SchedulerOutput
from workers.runner.batch_inputs import BatchInputs
from workers.runner.step_sample import DraftTokens, StepTokens
from workers.runner.token_copy import TokenTransfer

if TYPE_CHECKING:
    from workers.attention.reference import AttentionMetadata
    from workers.runner.graph_buckets import Bucket


@dataclass(eq=False)
class PreparedStep:
    so: SchedulerOutput
    failed: dict[int, str]  # new requests of this diff whose sampling state failed
    inputs: BatchInputs | None = None  # None: nothing scheduled
    # the device inputs: eager (ids, positions, metadata), or a staged CUDA graph bucket
    eager: tuple[torch.Tensor, torch.Tensor,
                 AttentionMetadata | list[AttentionMetadata]] | None = None
    bucket: Bucket | None = None
    logits_indices: np.ndarray | None = None  # into the (padded) hidden states
    prep_us: float = 0.0


def _no_handles() -> np.ndarray:
    return np.zeros(0, dtype=np.int32)


@dataclass(eq=False)
class InFlightStep:
    so: SchedulerOutput
    prep_us: float
    transfer: TokenTransfer
    inputs: BatchInputs | None = None
    handles: np.ndarray = field(default_factory=_no_handles)  # sampling rows' requests
    # the sampled tokens, plain or verified drafts; a step that samples nothing has none
    tokens: StepTokens | DraftTokens = field(default_factory=StepTokens)
    # whether the next step may be prepared before this one finishes: False when nothing
    # runs on the device to hide behind, or the tokens' counts are needed first (drafts)
    overlappable: bool = False
    # the worker's host time before this step's launch, hidden behind the step before on the
    # device / not hidden (workers/overlap.py)
    hidden_us: float = 0.0
    exposed_us: float = 0.0
