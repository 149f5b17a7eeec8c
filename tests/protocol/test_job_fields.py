"""A request's options travel only when set: a request with none pays one byte for them (an
empty map), and a job round-trips inside them."""

from __future__ import annotations

from engine_core.frontend.validation import validate_job
from protocol.codec import Encoder, frontend_decoder
from protocol.messages import AddRequest, SamplingParams
from protocol.request_options import JobInfo, RequestOptions

FIELDS: dict = dict(request_id="r", prompt_token_ids=b"\x01\x00\x00\x00",
                    sampling_params=SamplingParams(), arrival_time=1.5)


def test_no_options_cost_one_byte_and_a_job_round_trips() -> None:
    enc = Encoder()
    plain = enc.encode(AddRequest(**FIELDS))
    # the same request with the options field dropped: the difference is the empty map
    bare = enc.encode(AddRequest(**FIELDS, options=RequestOptions(priority=0)))
    assert plain == bare and plain.endswith(b"\x80")
    job = RequestOptions(job=JobInfo(job_id="j", tool_name="ls"))
    with_job = enc.encode(AddRequest(**FIELDS, options=job))
    assert len(with_job) > len(plain)
    dec = frontend_decoder()
    back = dec.decode(with_job)
    assert isinstance(back, AddRequest)
    assert back.options.job == JobInfo(job_id="j", is_last_step=False, tool_name="ls")
    assert dec.decode(plain).options == RequestOptions()


def test_bad_job_values_get_a_clear_error() -> None:
    assert validate_job(JobInfo(job_id="j" * 256)) is None
    assert "256 bytes" in (validate_job(JobInfo(job_id="j" * 257)) or "")
    assert "string" in (validate_job(JobInfo(job_id=5)) or "")  # type: ignore[arg-type]
    assert "boolean" in (validate_job(JobInfo(job_id="j", is_last_step="yes")) or "")  # type: ignore[arg-type]
