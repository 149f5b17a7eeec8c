"""``kv_transfer_params`` in a request body (vLLM's P/D field): typed here, so a bad value is a
400 naming the field before anything is sent to the engine."""

from __future__ import annotations

from typing import Any

import msgspec

from launch.serve.errors import bad_request
from protocol.kv_connector import MAX_REMOTE_BLOCKS, KVTransferParams, params_field_error


def request_kv_params(raw: dict[str, Any] | None, num_choices: int,
                      max_blocks: int = MAX_REMOTE_BLOCKS) -> KVTransferParams | None:
    """The request's params, checked; ``max_blocks``: the blocks a request can hold here
    (max_model_len's), which bounds remote_block_ids."""
    if raw is None:
        return None
    # vLLM's NixlConnector reads a null as "not known yet" (a router's prefill request sends
    # remote_engine_id: null and the like): a null is the field's default here. Unknown keys
    # are ignored by the struct; the types of the keys it knows stay strict.
    known = {k: v for k, v in raw.items() if v is not None}
    try:
        params = msgspec.convert(known, KVTransferParams)
    except msgspec.ValidationError as e:
        raise bad_request(f"kv_transfer_params: {e}", "kv_transfer_params") from e
    bounded = params_field_error(params, max_blocks)
    if bounded is not None:
        field, why = bounded
        raise bad_request(why, field)
    if not (params.do_remote_decode or params.do_remote_prefill):
        return None  # nothing asked of P/D: an ordinary request
    if num_choices != 1:
        raise bad_request("kv_transfer_params needs one prompt and n = 1", "kv_transfer_params")
    return params
