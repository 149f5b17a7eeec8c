"""Admission checks on a new request: a clear, specific reason, or None when it is fine.

Rejected requests get finish_reason "error" with this text; nobody else is affected.
"""

from __future__ import annotations

import math

from protocol.messages import SamplingParams


def validate_sampling(sp: SamplingParams) -> str | None:
    t = sp.temperature
    if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t):
        return f"temperature must be a finite number, got {t!r}"
    if t < 0:
        return f"temperature must be >= 0, got {t}"
    if math.isnan(sp.top_p) or not 0.0 < sp.top_p <= 1.0:
        return f"top_p must be in (0, 1], got {sp.top_p}"
    if sp.top_k < -1:
        return f"top_k must be -1 or 0 (off) or a positive integer, got {sp.top_k}"
    if math.isnan(sp.min_p) or not 0.0 <= sp.min_p <= 1.0:
        return f"min_p must be in [0, 1], got {sp.min_p}"
    if sp.max_tokens < 1:
        return f"max_tokens must be >= 1, got {sp.max_tokens}"
    if sp.min_tokens < 0:
        return f"min_tokens must be >= 0, got {sp.min_tokens}"
    if sp.min_tokens > sp.max_tokens:
        return f"min_tokens ({sp.min_tokens}) must be <= max_tokens ({sp.max_tokens})"
    return None


def validate_prompt(prompt: list[int], vocab_size: int) -> str | None:
    """Token ids must exist. Too-long prompts are the scheduler's (FINISHED_IGNORED)."""
    if not prompt:
        return "prompt is empty: at least one token is needed"
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        return f"token id {bad} is outside the vocabulary [0, {vocab_size})"
    return None
