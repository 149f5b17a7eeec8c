"""The options of one request besides its prompt and sampling parameters, as one value.

Built once where a request enters (the Python API, the HTTP server) and carried whole: through
the frontend, on the wire inside AddRequest, into the engine core's Request. Adding an option
touches this struct and the code that reads the option, not every signature in between (they
once re-listed each option in order, and a positional slip sent an adapter where the P/D
parameters go).

Encoded as a map with defaults omitted: a request with no options pays one byte (an empty map),
each option set pays for itself only.
"""

from __future__ import annotations

import msgspec

from protocol.kv_connector import KVTransferParams
from protocol.lora import LoRARequest
from protocol.multimodal import MMItem


class JobInfo(msgspec.Struct, array_like=True, kw_only=True, omit_defaults=True):
    """The agent program a request is one turn of (the continuum scheduling policy)."""

    job_id: str
    is_last_step: bool = False  # no next turn follows: nothing to keep for it
    tool_name: str | None = None  # the tool the client runs after this turn (a TTL hint)


class RequestOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    priority: int = 0  # the priority policy's order (lower first)
    cache_salt: str | None = None  # prefix-cache isolation: only equal salts share blocks
    job: JobInfo | None = None  # the agent program this request is a turn of
    kv_transfer_params: KVTransferParams | None = None  # disaggregated prefill / decode
    lora: LoRARequest | None = None  # the adapter it runs with; None: the base model
    # the prompt's images, processed, in prompt order (launch/multimodal/); [] for text
    mm: list[MMItem] = []


NO_OPTIONS = RequestOptions()
