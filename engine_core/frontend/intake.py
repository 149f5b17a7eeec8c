"""An AddRequest from the frontend made into a Request, after the engine core's own checks.

The frontend checks the same things first; these run again here because the engine core is
the one place every request passes, whoever sent it (a bad frame must fail its request alone,
never the engine).
"""

from __future__ import annotations

import time

from engine_core.frontend.validation import (
    job_fields,
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
from protocol.messages import AddJobRequest, AddRequest


def request_from(msg: AddRequest, vocab_size: int, eos_token_id: int | None, *,
                 lora_enabled: bool, kv_enabled: bool) -> Request | str:
    """The Request ``msg`` asks for, or why it is refused."""
    job = msg.job if isinstance(msg, AddJobRequest) else None
    try:
        prompt = unpack(msg.prompt_token_ids)
    except ProtocolError as e:
        return str(e)
    if msg.lora is not None and not lora_enabled:
        return NOT_ENABLED
    err = (
        validate_request_id(msg.request_id)
        or validate_cache_salt(msg.cache_salt)
        or (not kv_enabled and msg.kv_transfer_params is not None
         and "kv_transfer_params needs an engine started with --kv-transfer-config")
        or validate_sampling(msg.sampling_params)
        or validate_priority(msg.priority)
        or validate_job(job)
        or validate_prompt(prompt, vocab_size)
    )
    if err:
        return err
    return Request(
        msg.request_id,
        prompt,
        msg.sampling_params,
        eos_token_id,
        msg.arrival_time or time.time(),
        priority=msg.priority,
        cache_salt=msg.cache_salt,
        kv_transfer_params=msg.kv_transfer_params,
        lora=msg.lora,
        **job_fields(job),
    )
