"""The worker model used by the diff property test refuses inconsistent diffs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from protocol.codec import pack
from protocol.messages import NewRequestData, SamplingParams, SchedulerOutput

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker_model import WorkerModel, WorkerStateError  # noqa: E402


def admit(handle: int, step_id: int = 0) -> SchedulerOutput:
    nr = NewRequestData(
        handle=handle,
        prompt_token_ids=pack([5, 6, 7]),
        sampling_params=SamplingParams(),
        block_ids=pack([1]),
        num_computed_tokens=0,
        num_scheduled_tokens=3,
    )
    return SchedulerOutput(
        step_id=step_id, new_reqs=[nr], num_running=1, total_num_scheduled_tokens=3
    )


def test_admit_then_steady_decode() -> None:
    w = WorkerModel()
    assert w.apply(admit(4)) == {4: 3}
    w.execute(0, {4: 9})
    assert w.reqs[4].tokens == [5, 6, 7, 9]
    assert w.apply(SchedulerOutput(step_id=1, num_running=1, total_num_scheduled_tokens=1)) == {
        4: 1
    }
    w.execute(1, {4: 2})
    assert w.reqs[4].num_computed_tokens == 4
    assert w.reqs[4].tokens == [5, 6, 7, 9, 2]


@pytest.mark.parametrize(
    "so",
    [
        SchedulerOutput(step_id=2, num_running=1, total_num_scheduled_tokens=1),  # gap
        SchedulerOutput(step_id=1, num_running=2, total_num_scheduled_tokens=1),
        SchedulerOutput(step_id=1, num_running=1, total_num_scheduled_tokens=2),
        SchedulerOutput(step_id=1, finished_handles=pack([8]), num_running=1),
        SchedulerOutput(step_id=1, preempted_handles=pack([8]), num_running=1),
        SchedulerOutput(step_id=1, sched_override_handles=pack([4]), num_running=1),  # ragged
    ],
)
def test_inconsistent_diffs_are_refused(so: SchedulerOutput) -> None:
    w = WorkerModel()
    w.apply(admit(4))
    w.execute(0, {4: 9})
    with pytest.raises((WorkerStateError, ValueError)):
        w.apply(so)
