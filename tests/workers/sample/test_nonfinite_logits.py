"""A row whose logits are NaN or +inf (a bad adapter, bad weights) has no distribution: the
sampler gives it a placeholder token inside the vocabulary and flags it, and the runner fails
that row's request alone while every other row of the batch samples as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.codec import pack, unpack
from protocol.messages import NewRequestData, SamplingParams, SchedulerOutput
from tests.helpers.runner import make_runner
from workers.runner.request_guard import NONFINITE_REASON
from workers.sample.sampler import Sampler, SamplingMetadata


def _md(temps: list[float], logprobs: bool) -> SamplingMetadata:
    n = len(temps)
    return SamplingMetadata(temperature=np.array(temps, dtype=np.float32),
                            top_k=np.zeros(n, dtype=np.int32), top_p=np.ones(n, np.float32),
                            min_p=np.zeros(n, np.float32), need_logprobs=logprobs)


@pytest.mark.parametrize("temps", [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0],
                                   [1.0, 0.0, 1.0, 0.0]])
@pytest.mark.parametrize("logprobs", [False, True])
def test_non_finite_rows_are_flagged_and_others_sample_as_before(temps, logprobs) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=gen)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, :500] = float("-inf")  # masked tokens are not a fault
    poisoned = Sampler(seed=5).sample(logits, _md(temps, logprobs))
    clean = logits.clone()
    clean[1:3] = 0.0
    ref = Sampler(seed=5).sample(clean, _md(temps, logprobs))
    assert poisoned.nonfinite is not None
    assert poisoned.nonfinite.tolist() == [False, True, True, False]
    assert poisoned.token_ids[1:3].tolist() == [0, 0]
    keep = [0, 3]
    assert poisoned.token_ids[keep].tolist() == ref.token_ids[keep].tolist()
    assert ((poisoned.token_ids >= 0) & (poisoned.token_ids < 1000)).all()
    if logprobs:
        assert poisoned.logprobs is not None and ref.logprobs is not None
        assert torch.equal(poisoned.logprobs[keep], ref.logprobs[keep])


def test_runner_fails_only_the_request_with_non_finite_logits(monkeypatch) -> None:
    runner = make_runner()
    assert runner.model is not None
    real = runner.model.compute_logits

    def poisoned(hidden: torch.Tensor) -> torch.Tensor:
        out = real(hidden).clone()
        out[1, 5] = float("nan")  # the second sampling row: request handle 1
        return out

    monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    sp = SamplingParams(max_tokens=4, temperature=1.0, logprobs=True)
    new = [NewRequestData(handle=h, prompt_token_ids=pack([3 + h, 4, 5]),
                          block_ids=pack([1 + 2 * h, 2 + 2 * h]), sampling_params=sp,
                          num_computed_tokens=0, num_scheduled_tokens=3) for h in range(3)]
    out = runner.execute(SchedulerOutput(step_id=0, new_reqs=new, num_running=3,
                                         total_num_scheduled_tokens=9))
    assert unpack(out.req_handles) == [0, 1, 2]
    tokens = unpack(out.sampled_token_ids)
    assert all(0 <= t < runner.model_config.vocab_size for t in tokens)
    assert unpack(out.failed_handles) == [1]
    assert out.failed_reasons == [NONFINITE_REASON]
    # the next step runs with the failed row still in it (its placeholder token is a valid
    # input; the engine core drops the request in the next diff) and fails no one
    monkeypatch.setattr(runner.model, "compute_logits", real)
    out = runner.execute(SchedulerOutput(step_id=1, num_running=3, total_num_scheduled_tokens=3))
    assert unpack(out.req_handles) == [0, 1, 2] and out.failed_handles == b""
