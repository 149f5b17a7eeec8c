"""A request's job travels only when set (AddJobRequest): no byte is added without one."""

from __future__ import annotations

import msgspec

from engine_core.frontend.validation import validate_job
from protocol.codec import Encoder, frontend_decoder
from protocol.messages import AddJobRequest, AddRequest, JobInfo, SamplingParams

FIELDS: dict = dict(request_id="r", prompt_token_ids=b"\x01\x00\x00\x00",
                    sampling_params=SamplingParams(), arrival_time=1.5)


def _add(job: JobInfo | None) -> AddRequest:
    return AddRequest(**FIELDS) if job is None else AddJobRequest(**FIELDS, job=job)


def test_no_job_costs_no_bytes_and_a_job_round_trips() -> None:
    enc = Encoder()
    plain = enc.encode(_add(None))
    # the tag and the eight fields of a request (no adapter, no kv_transfer_params: nils):
    # nothing for the job
    assert len(msgspec.msgpack.decode(msgspec.msgpack.encode(_add(None)))) == 9
    with_job = enc.encode(_add(JobInfo(job_id="j", tool_name="ls")))
    assert len(with_job) > len(plain)
    dec = frontend_decoder()
    assert type(dec.decode(plain)) is AddRequest
    back = dec.decode(with_job)
    assert isinstance(back, AddJobRequest)
    assert back.job == JobInfo(job_id="j", is_last_step=False, tool_name="ls")


def test_bad_job_values_get_a_clear_error() -> None:
    assert validate_job(JobInfo(job_id="j" * 256)) is None
    assert "256 bytes" in (validate_job(JobInfo(job_id="j" * 257)) or "")
    assert "string" in (validate_job(JobInfo(job_id=5)) or "")  # type: ignore[arg-type]
    assert "boolean" in (validate_job(JobInfo(job_id="j", is_last_step="yes")) or "")  # type: ignore[arg-type]
