"""The agent-job fields of a request (job_id, is_last_step, tool_name) as the API takes them:
one value for every prompt, or one per prompt (like priority)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

from protocol.request_options import JobInfo

T = TypeVar("T")


def _per_prompt(n: int, value: T | Sequence[T], name: str, scalar: type) -> list[T]:
    if isinstance(value, list | tuple) and not isinstance(value, scalar):
        seq: list[T] = list(value)
        if len(seq) != n:
            raise ValueError(f"{len(seq)} values of {name} for {n} prompts")
        return seq
    # one value for every prompt; a value of the wrong type is passed on the same way (hence
    # the cast), for the client's validation to name it
    return [cast(T, value)] * n


def job_infos(
    n: int,
    job_id: str | Sequence[str | None] | None,
    is_last_step: bool | Sequence[bool] = False,
    tool_name: str | Sequence[str | None] | None = None,
) -> list[JobInfo | None] | None:
    """One JobInfo (or None: no job) per prompt; None when no prompt has a job. Values are
    not checked here: the client's validation refuses a bad one with a clear error."""
    if job_id is None:
        return None
    ids: list[str | None] = _per_prompt(n, job_id, "job_id", str)
    last: list[bool] = _per_prompt(n, is_last_step, "is_last_step", bool)
    tools: list[str | None] = _per_prompt(n, tool_name, "tool_name", str)
    return [
        None if j is None else JobInfo(job_id=j, is_last_step=lst, tool_name=t)
        for j, lst, t in zip(ids, last, tools, strict=True)
    ]
