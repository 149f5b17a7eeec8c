"""A worker that fails on one request's values fails that request only: at TP=2 both ranks
agree (checksums on), the engine keeps serving, and the other requests' tokens are unchanged.

The failure is injected (TANDEM_FAULT_REQUEST_SEED: a new request with that seed raises while
the workers build its state), because the engine core's own validation keeps every real bad
value away from the workers.
"""

from __future__ import annotations

import pytest

from launch.llm import LLM
from protocol.messages import SamplingParams
from tests.helpers.procs import wait_no_descendants

FAULT_SEED = 424242
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.8, seed=7, ignore_eos=True)


def test_request_fault_in_workers_fails_only_that_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_FAULT_REQUEST_SEED", str(FAULT_SEED))
    llm = LLM("dummy:micro", 2, load_tokenizer=False, max_model_len=128, enable_checksum=True,
              startup_timeout_s=120)
    try:
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
        before = llm.generate(prompts[1:], [GREEDY, SEEDED], use_tqdm=False, timeout_s=60)
        bad = SamplingParams(max_tokens=6, temperature=0.8, seed=FAULT_SEED, ignore_eos=True)
        outs = llm.generate(prompts, [bad, GREEDY, SEEDED], use_tqdm=False, timeout_s=60)
        assert outs[0].finish_reason == "error", outs[0]
        assert "injected request fault" in (outs[0].error or "")
        assert not outs[0].token_ids
        for o, ref in zip(outs[1:], before, strict=True):
            assert o.finish_reason == "length" and o.token_ids == ref.token_ids
        # still serving, every rank alive and in step
        again = llm.generate(prompts[1:], [GREEDY, SEEDED], use_tqdm=False, timeout_s=60)
        assert [o.token_ids for o in again] == [o.token_ids for o in before]
        assert all(llm.health().alive)
    finally:
        llm.shutdown()
        assert wait_no_descendants(10) == []
