"""An idle engine stays alive: the workers' health pongs count while no step is in flight.

Regression: the core only read the workers' socket inside a step, so after worker_timeout_s
without requests it declared every rank hung and shut down (a server died after 30 s of quiet).
"""

from __future__ import annotations

import time

from launch import LLM, SamplingParams
from tests.helpers.procs import wait_no_descendants


def test_engine_survives_idle_longer_than_worker_timeout() -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    try:
        with LLM(model="dummy:micro", tensor_parallel_size=2, worker_timeout_s=2.0) as llm:
            first = llm.generate([[1, 2, 3]], params, use_tqdm=False, timeout_s=60)[0]
            time.sleep(5.0)  # 2.5x the timeout with nothing to do
            second = llm.generate([[1, 2, 3]], params, use_tqdm=False, timeout_s=60)[0]
    finally:
        left = wait_no_descendants(10)
    assert left == []
    assert first.finish_reason == "length", first.error
    assert second.finish_reason == "length", second.error
    assert second.token_ids == first.token_ids
