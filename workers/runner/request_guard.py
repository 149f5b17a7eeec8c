"""A new request's sampling state, built so that a bad value fails that request, not the rank.

The engine core validates every request before scheduling it, so nothing here should ever
fail. If something still does (a value the checks missed, a generator the device refuses), the
request keeps its row with neutral, greedy sampling so the step's shapes and every other
request stay as planned, and its handle is reported in ModelRunnerOutput.failed_handles; the
engine core then finishes it with finish_reason "error" and drops its token. Every rank runs
this same deterministic code on the same broadcast values, so every rank fails the same
requests and TP ranks stay in step (with checksums on, the failed handles are part of the
compared checksum).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from protocol.codec import pack
from protocol.messages import SamplingParams

# TEST-ONLY: a new request with this seed raises while its state is built, on every rank, so
# the suite can prove a request-level failure in a worker finishes only that request.
FAULT_SEED_ENV = "TANDEM_FAULT_REQUEST_SEED"


def _fault_seed() -> int | None:
    v = os.environ.get(FAULT_SEED_ENV)
    return int(v) if v else None


_FAULT_SEED = _fault_seed()


def admit_sampling(sp: SamplingParams) -> tuple[SamplingParams, str | None]:
    """(params to run with, None) or (neutral params, reason)."""
    try:
        if _FAULT_SEED is not None and sp.seed == _FAULT_SEED:
            raise RuntimeError(f"injected request fault (seed {sp.seed})")
        # the values the input batch stores in int32 / float32 arrays must fit them
        np.array([sp.top_k, sp.max_tokens, sp.min_tokens], dtype=np.int32)
        for name in ("temperature", "top_p", "min_p"):
            v = float(getattr(sp, name))
            if not math.isfinite(v) or not math.isfinite(float(np.float32(v))):
                raise ValueError(f"{name}={v} is not a finite float32")
        # the counter-based sampler keys its random numbers on the seed as a uint64
        if sp.seed is not None and not -(2**63) <= sp.seed < 2**64:
            raise ValueError(f"seed={sp.seed} does not fit 64 bits")
        return sp, None
    except Exception as e:  # noqa: BLE001 - any failure is this request's, not the rank's
        neutral = SamplingParams(max_tokens=1, temperature=0.0)
        return neutral, f"worker rejected the request: {type(e).__name__}: {e}"


def take_failed(failed: dict[int, str]) -> tuple[np.ndarray, list[str]] | None:
    """This step's failed handles (int32) and reasons, emptying `failed`; None when none."""
    if not failed:
        return None
    handles = np.fromiter(failed.keys(), dtype=np.int32, count=len(failed))
    reasons = list(failed.values())
    failed.clear()
    return handles, reasons


def failed_fields(failed: tuple[np.ndarray, list[str]] | None) -> dict[str, Any]:
    """ModelRunnerOutput's keyword arguments for them (none at all in the usual case)."""
    if failed is None:
        return {}
    return {"failed_handles": pack(failed[0]), "failed_reasons": failed[1]}


NONFINITE_REASON = ("the model's logits for this request are not finite (NaN or inf): it has "
                    "no distribution to sample from")


def fail_nonfinite_rows(batch: Any, handles: np.ndarray | None, sampled: np.ndarray) -> None:
    """The sampler marks a row whose logits were NaN / +inf with token -1 in the host copy:
    fail that row's request alone (the engine core drops its token) and put the placeholder
    0 in its place, as on the device. Every rank saw the same logits: the same rows fail."""
    if not len(sampled):
        return
    bad = np.flatnonzero(sampled < 0)
    if not len(bad):
        return
    assert handles is not None
    for row in bad.tolist():
        batch.failed[int(handles[row])] = NONFINITE_REASON
    sampled[bad] = 0
