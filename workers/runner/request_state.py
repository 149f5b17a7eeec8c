"""What a worker remembers of each request between steps, and the wire arrays it reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protocol.codec import ProtocolError, unpack_np
from protocol.lora import LoRAStep
from protocol.messages import SamplingParams
from workers.runner.block_table import StateMismatchError


def unpack_i32(data: bytes, what: str = "field") -> np.ndarray:
    """A packed wire array (uint16 or int32, see protocol.codec.pack) as int32."""
    try:
        return unpack_np(data).astype(np.int32, copy=False)
    except ProtocolError as e:
        raise StateMismatchError(f"{what}: {e}") from None


def new_request_loras(step: LoRAStep | None) -> dict[int, int]:
    """handle -> lora_int_id of the step's new requests that run an adapter (the others, and
    every step without LoRA, appear nowhere)."""
    if step is None or not step.handles:
        return {}
    handles = unpack_i32(step.handles, "lora handles")
    ids = unpack_i32(step.lora_int_ids, "lora_int_ids")
    if len(handles) != len(ids) or (ids < 1).any():
        raise StateMismatchError(f"lora: {len(handles)} handles but {len(ids)} lora_int_ids, "
                                 "or an id < 1")
    return dict(zip(handles.tolist(), ids.tolist(), strict=True))


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
    lora_int_id: int = 0  # the LoRA adapter it runs with; 0 = the base model
