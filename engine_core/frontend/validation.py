"""Admission checks on a new request: a clear, specific reason, or None when it is fine.

Rejected requests get finish_reason "error" with this text; nobody else is affected. The same
checks run in the HTTP server and the Python API's client before a request is encoded (a value
msgpack cannot carry must never reach the codec) and again in the engine core for every
AddRequest (a direct ZeroMQ peer gets the same answer), so nothing a worker stores in a
fixed-width array can be out of its range.

Seed policy: any 64-bit integer, signed or unsigned ([-2**63, 2**64 - 1], what msgpack and
torch.Generator.manual_seed take), is accepted; anything else is refused. Choice j of an n > 1
request uses (seed + j) mod 2**64 (see derived_seed).
"""

from __future__ import annotations

import math

from protocol.messages import SamplingParams
from protocol.structured import structured_error

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
FLOAT32_MAX = 3.4028234663852886e38  # workers keep temperature etc. in float32 arrays


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def sampling_error(sp: SamplingParams) -> tuple[str, str] | None:
    """(field, reason) of the first invalid sampling value, or None."""
    t = sp.temperature
    if not _finite(t):
        return "temperature", f"temperature must be a finite number, got {t!r}"
    if t < 0:
        return "temperature", f"temperature must be >= 0, got {t}"
    if t > FLOAT32_MAX:
        return "temperature", f"temperature must be <= {FLOAT32_MAX:.4g} (float32), got {t}"
    if not _finite(sp.top_p) or not 0.0 < sp.top_p <= 1.0:
        return "top_p", f"top_p must be in (0, 1], got {sp.top_p}"
    if not _is_int(sp.top_k) or sp.top_k < -1:
        return "top_k", f"top_k must be -1 or 0 (off) or a positive integer, got {sp.top_k}"
    if sp.top_k > INT32_MAX:  # workers keep top_k in an int32 array
        return "top_k", f"top_k must be <= {INT32_MAX}, got {sp.top_k}"
    if not _finite(sp.min_p) or not 0.0 <= sp.min_p <= 1.0:
        return "min_p", f"min_p must be in [0, 1], got {sp.min_p}"
    if not _is_int(sp.max_tokens) or sp.max_tokens < 1:
        return "max_tokens", f"max_tokens must be >= 1, got {sp.max_tokens}"
    if sp.max_tokens > INT32_MAX:
        return "max_tokens", f"max_tokens must be <= {INT32_MAX}, got {sp.max_tokens}"
    if not _is_int(sp.min_tokens) or sp.min_tokens < 0:
        return "min_tokens", f"min_tokens must be >= 0, got {sp.min_tokens}"
    if sp.min_tokens > sp.max_tokens:
        return "min_tokens", (
            f"min_tokens ({sp.min_tokens}) must be <= max_tokens ({sp.max_tokens})"
        )
    if sp.seed is not None and (not _is_int(sp.seed) or not SEED_MIN <= sp.seed <= SEED_MAX):
        return "seed", f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {sp.seed}"
    for t_id in sp.stop_token_ids:
        if not _is_int(t_id) or not 0 <= t_id <= INT32_MAX:
            return "stop_token_ids", (
                f"stop_token_ids must hold token ids in [0, {INT32_MAX}], got {t_id}"
            )
    if sp.structured_outputs is not None:
        reason = structured_error(sp.structured_outputs)
        if reason is not None:
            return "structured_outputs", reason
    return None


def validate_sampling(sp: SamplingParams) -> str | None:
    err = sampling_error(sp)
    return None if err is None else err[1]


def validate_priority(priority: object) -> str | None:
    # the scheduler's priority queue orders by it; int32 keeps it encodable everywhere
    ok = isinstance(priority, int) and not isinstance(priority, bool)
    if not ok or not INT32_MIN <= priority <= INT32_MAX:  # type: ignore[operator]
        return f"priority must be an integer in [{INT32_MIN}, {INT32_MAX}], got {priority}"
    return None


# A request id names its request in logs, outputs and (P/D) peer messages: printable text of
# bounded length. The HTTP server takes ids of up to 256 characters and adds a choice suffix.
MAX_REQUEST_ID_CHARS = 512
MAX_CACHE_SALT_CHARS = 1024


def validate_request_id(request_id: object) -> str | None:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        n = len(request_id) if isinstance(request_id, str) else type(request_id).__name__
        return f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters, got {n}"
    if not request_id.isprintable():
        return "request_id must be printable text (no control characters)"
    return None


def validate_cache_salt(salt: object) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        return f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters"
    return None


MAX_JOB_FIELD_BYTES = 256


def validate_job(job: object) -> str | None:
    """A job's id and tool hint are short strings (they key the scheduler's job tables)."""
    if job is None:
        return None
    job_id = getattr(job, "job_id", None)
    if not isinstance(job_id, str) or not job_id:
        return f"job_id must be a non-empty string, got {job_id!r}"
    if len(job_id.encode()) > MAX_JOB_FIELD_BYTES:
        return f"job_id must be at most {MAX_JOB_FIELD_BYTES} bytes"
    if not isinstance(getattr(job, "is_last_step", False), bool):
        return "is_last_step must be a boolean"
    tool = getattr(job, "tool_name", None)
    if tool is not None and (not isinstance(tool, str) or len(tool.encode()) > MAX_JOB_FIELD_BYTES):
        return f"tool_name must be a string of at most {MAX_JOB_FIELD_BYTES} bytes"
    return None


def derived_seed(seed: int, j: int) -> int:
    """The seed of choice j of an n > 1 request: distinct per choice, reproducible, and in
    range whatever the base seed (choice 0 keeps the seed as given)."""
    return seed if j == 0 else (seed + j) % 2**64


def validate_prompt(prompt: list[int], vocab_size: int) -> str | None:
    """Token ids must exist. Too-long prompts are the scheduler's (FINISHED_IGNORED)."""
    if not prompt:
        return "prompt is empty: at least one token is needed"
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        return f"token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None
