"""Requests the workers could not run: finished with "error", everyone else keeps going.

A worker that fails to build one request's state reports its handle in
ModelRunnerOutput.failed_handles instead of dying (workers/runner/request_guard.py). Finishing
it here, before the step's tokens are applied, drops the token it was given (the update skips
handles it no longer knows) and tells the workers to forget it in the next step's diff.
"""

from __future__ import annotations

import logging

from engine_core.request import RequestStatus
from engine_core.sched.scheduler import Scheduler
from protocol.codec import unpack
from protocol.messages import ModelRunnerOutput

logger = logging.getLogger(__name__)


def finish_failed_requests(scheduler: Scheduler, out: ModelRunnerOutput) -> None:
    if not out.failed_handles:
        return
    handles = unpack(out.failed_handles)
    for handle, reason in zip(handles, out.failed_reasons, strict=False):
        req = scheduler.by_handle.get(handle)
        if req is None:  # finished or aborted since
            continue
        logger.warning("request %s failed in the workers: %s", req.request_id, reason)
        req.error = reason
        scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ERROR)
