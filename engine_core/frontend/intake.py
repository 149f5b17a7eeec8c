"""An AddRequest from the frontend made into a Request, after the engine core's own checks.

The frontend checks the same things first; these run again here because the engine core is
the one place every request passes, whoever sent it (a bad frame must fail its request alone,
never the engine).
"""

from __future__ import annotations

import time

from engine_core.frontend.validation import (
    validate_cache_salt,
    validate_job,
    validate_priority,
    validate_prompt,
    validate_request_id,
    validate_sampling,
)
from engine_core.lora.registry import NOT_ENABLED
from engine_core.request import Request
from protocol.codec import ProtocolError, unpack
from protocol.messages import AddRequest


def request_from(msg: AddRequest, vocab_size: int, eos_token_id: int | None, *,
                 lora_enabled: bool, kv_enabled: bool) -> Request | str:
    """The Request ``msg`` asks for, or why it is refused."""
    opts = msg.options
    try:
        prompt = unpack(msg.prompt_token_ids)
    except ProtocolError as e:
        return str(e)
    if opts.lora is not None and not lora_enabled:
        return NOT_ENABLED
    err = (
        validate_request_id(msg.request_id)
        or validate_cache_salt(opts.cache_salt)
        or (not kv_enabled and opts.kv_transfer_params is not None
            and "kv_transfer_params needs an engine started with --kv-transfer-config")
        or validate_sampling(msg.sampling_params)
        or validate_priority(opts.priority)
        or validate_job(opts.job)
        or validate_prompt(prompt, vocab_size)
    )
    if err:
        return err
    return Request(msg.request_id, prompt, msg.sampling_params, eos_token_id,
                   msg.arrival_time or time.time(), opts)
