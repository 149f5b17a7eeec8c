"""What a worker remembers of each request between steps, and the wire arrays it reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protocol.codec import ProtocolError, unpack_np
from protocol.messages import SamplingParams
from workers.runner.block_table import StateMismatchError


def unpack_i32(data: bytes, what: str = "field") -> np.ndarray:
    """A packed wire array (uint16 or int32, see protocol.codec.pack) as int32."""
    try:
        return unpack_np(data).astype(np.int32, copy=False)
    except ProtocolError as e:
        raise StateMismatchError(f"{what}: {e}") from None


@dataclass(eq=False)
class CachedRequestState:
    """What a worker remembers of a request, also while it is preempted.

    While the request is in the batch its row is authoritative for tokens, block table and
    num_computed_tokens; output_token_ids is synced from the row when it leaves the batch.
    """

    handle: int
    prompt_token_ids: np.ndarray  # int32
    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    row: int = -1  # -1 = not in the batch (preempted)
