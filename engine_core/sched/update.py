"""The Scheduler's model-results half: update_from_output and its helpers.

Kept apart from scheduler.py (the planning half) so each file holds one concept. These are
functions of the scheduler's state (UpdateTarget, which Scheduler satisfies structurally):
Scheduler.update_from_output calls update_from_output(self, ...), and gives the features
(the offload tier's reads, the trace) the step's results around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine_core.request import FINISH_REASONS, Request, RequestStatus
from engine_core.sched.interface import SchedulerView
from protocol.codec import unpack, unpack_f32
from protocol.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine_core.sched.running_set import RunningSet

RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED
STOPPED = RequestStatus.FINISHED_STOPPED
LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


class UpdateTarget(SchedulerView, Protocol):
    """What applying a step's results reads and changes of the scheduler."""

    spec_by_step: dict[int, dict[int, list[int]]]  # drafts sent with each step in flight
    num_draft_tokens: int
    num_accepted_tokens: int
    num_spec_verifications: int
    running_set: RunningSet  # the one owner of the running list

    def free_request(self, req: Request, status: RequestStatus) -> None:
        """Mark finished and release everything; the caller removes it from its queue."""
        ...


def update_from_output(
    s: UpdateTarget, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
) -> list[EngineCoreOutput]:
    handles = unpack(model_output.req_handles)
    tokens = unpack(model_output.sampled_token_ids)
    spec = s.spec_by_step.pop(scheduler_output.step_id, None)
    if model_output.num_tokens:
        counts = unpack(model_output.num_tokens)
    else:
        counts = None
    by_handle = s.by_handle
    outputs: list[EngineCoreOutput] = []
    finished: list[tuple[Request, RequestStatus]] = []
    # One float32 per sampled token whenever any request of the step asked for logprobs.
    lps = unpack_f32(model_output.logprobs) if model_output.logprobs else None
    if counts is None and spec is None and lps is None:
        _update_one_token_each(s, handles, tokens, outputs, finished)
        if finished:
            _free_finished(s, finished)
        return outputs
    pos = 0
    for k, handle in enumerate(handles):
        start = k if counts is None else pos
        end = start + (1 if counts is None else counts[k])
        pos = end
        new = tokens[start:end]
        req = by_handle.get(handle)
        if req is None:  # finished or aborted since the step was planned
            continue
        if req.status != RUNNING:
            if req.status == PREEMPTED:
                _update_preempted(s, req, new, outputs, _slice(lps, start, end, req))
            continue
        if req.num_computed_tokens < req.num_tokens:  # a partial prefill chunk
            continue
        if spec is not None:
            drafts = spec.get(handle)
            if drafts is not None:
                # drafts after the first rejected one were computed on wrong tokens:
                # their KV is recomputed (tokens = accepted drafts + one of the model's)
                num_accepted = len(new) - 1
                req.num_computed_tokens -= len(drafts) - num_accepted
                s.num_draft_tokens += len(drafts)
                s.num_accepted_tokens += num_accepted
                s.num_spec_verifications += 1
        new, status = _append_tokens(req, new)
        outputs.append(_output(req, new, status, _slice(lps, start, end, req)))
        if status is not None:
            finished.append((req, status))
    if finished:
        _free_finished(s, finished)
    return outputs


def _free_finished(s: UpdateTarget, finished: list[tuple[Request, RequestStatus]]) -> None:
    """Free the step's finished requests in handle (admission) order, not in the order of
    the worker's batch rows: the order of frees is the prefix cache's LRU order and the
    adapter slots', so it must follow from the scheduler's own decisions. Then a replay of
    the trace, whose fake worker knows nothing of the real one's rows, decides the same."""
    if len(finished) > 1:
        finished.sort(key=lambda f: f[0].handle or 0)  # a running request has a handle
    for req, status in finished:
        s.free_request(req, status)
    s.running_set.prune()


def _append_tokens(
    req: Request, new: list[int]
) -> tuple[list[int], RequestStatus | None]:
    """Append sampled tokens up to the first that stops the request; returns the tokens
    kept and the finished status (None = still running)."""
    for j, tok in enumerate(new):
        req.append_output_token(tok)
        if req.num_output_placeholders:
            req.num_output_placeholders -= 1
        if tok in req.stop_ids and len(req.output_token_ids) >= req.min_tokens:
            return new[: j + 1], STOPPED
        if req.num_tokens >= req.length_limit:
            return new[: j + 1], LENGTH_CAPPED
    return new, None


def _output(req: Request, new: list[int], status: RequestStatus | None,
            lps: list[float] | None = None) -> EngineCoreOutput:
    # logprobs of the tokens kept (a stop token ends the list early)
    new_lps = lps[: len(new)] if lps is not None else None
    if status is not None:
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new,
            finish_reason=FINISH_REASONS[status],
            num_cached_tokens=max(req.num_cached_tokens, 0),
            new_logprobs=new_lps,
        )
    if len(req.output_token_ids) == len(new) and req.num_cached_tokens > 0:
        # the first tokens: tell the frontend how much of the prompt was a cache hit
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new,
            num_cached_tokens=req.num_cached_tokens,
            new_logprobs=new_lps,
        )
    return EngineCoreOutput(request_id=req.request_id, new_token_ids=new, new_logprobs=new_lps)


def _update_preempted(s: UpdateTarget, req: Request, new: list[int],
                      outputs: list[EngineCoreOutput], lps: list[float] | None = None) -> None:
    """Async scheduling: a request preempted while a step that samples for it was in
    flight still takes that token. It was sampled from the right state and the workers
    kept it with the request's tokens, so dropping it would desynchronize them."""
    new, status = _append_tokens(req, new)
    outputs.append(_output(req, new, status, lps))
    if status is not None:
        s.waiting.remove_requests([req])
        s.free_request(req, status)


def _update_one_token_each(
    s: UpdateTarget, handles: list[int], tokens: list[int], outputs: list[EngineCoreOutput],
    finished: list[tuple[Request, RequestStatus]],
) -> None:
    """The common case (one sampled token per request, no drafts), kept lean because it
    runs for every decoding request on every step. The requests that finished go to
    ``finished``, for the caller to free."""
    by_handle = s.by_handle
    for handle, tok in zip(handles, tokens, strict=True):
        req = by_handle.get(handle)
        if req is None:  # finished or aborted since the step was planned
            continue
        if req.status != RUNNING:
            if req.status == PREEMPTED:
                _update_preempted(s, req, [tok], outputs)
            continue
        if req.num_computed_tokens < req.num_tokens:  # a partial prefill chunk
            continue
        req.append_output_token(tok)
        if req.num_output_placeholders:
            req.num_output_placeholders -= 1
        if tok in req.stop_ids and len(req.output_token_ids) >= req.min_tokens:
            status = STOPPED
        elif req.num_tokens >= req.length_limit:
            status = LENGTH_CAPPED
        else:
            if req.num_cached_tokens > 0 and len(req.output_token_ids) == 1:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req.request_id,
                        new_token_ids=[tok],
                        num_cached_tokens=req.num_cached_tokens,
                    )
                )
            else:
                outputs.append(EngineCoreOutput(request_id=req.request_id, new_token_ids=[tok]))
            continue
        outputs.append(
            EngineCoreOutput(
                request_id=req.request_id,
                new_token_ids=[tok],
                finish_reason=FINISH_REASONS[status],
                num_cached_tokens=max(req.num_cached_tokens, 0),
            )
        )
        finished.append((req, status))


def _slice(lps: list[float] | None, start: int, end: int, req: Request) -> list[float] | None:
    """This request's logprobs from the step's list, when it asked for them."""
    if lps is None or not req.sampling_params.logprobs:
        return None
    return lps[start:end]
