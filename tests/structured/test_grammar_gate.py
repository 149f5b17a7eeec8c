"""A constrained request waits outside the scheduler until every rank compiled its grammar.

Real processes, real xgrammar. A test-only hook (TANDEM_TEST_GRAMMAR_HOLD) keeps the workers'
compiles waiting until a file exists, so the test decides when a grammar is "slow" without any
timing: the unconstrained request must finish while the constrained one still waits. A grammar
the workers cannot compile (sent past the frontend's own check) fails only its request.
"""

from __future__ import annotations

import queue

import pytest

from engine_core.grammar_gate import GrammarGate
from engine_core.request import Request
from launch import LLM, SamplingParams, StructuredOutputsParams
from launch.client import Sink
from protocol.messages import GrammarReady, RequestOutput
from tests.helpers.procs import wait_no_descendants
from tests.serve.serve_helpers import make_tokenizer_dir

PLAIN = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _finish(sink: Sink, timeout_s: float = 120.0) -> RequestOutput:
    """The request's last output (its tokens gathered), waiting at most ``timeout_s``."""
    tokens: list[int] = []
    while True:
        for _, out, _ in sink.get(timeout=timeout_s):
            tokens += out.new_token_ids
            if out.finish_reason is not None:
                out.new_token_ids = tokens
                return out


def test_gate_admits_after_every_rank_and_fails_on_any() -> None:
    gate = GrammarGate(world_size=2)
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]))
    a, b = Request("a", [1], sp, 2, 0.0), Request("b", [1], sp, 2, 0.0)
    ta, tb = gate.hold(a).ticket, gate.hold(b).ticket
    assert "a" in gate and len(gate) == 2
    assert gate.answer(GrammarReady(rank=1, ticket=ta)) is None
    assert gate.answer(GrammarReady(rank=0, ticket=ta)) is a
    failed = gate.answer(GrammarReady(rank=1, ticket=tb, error="bad regex"))
    assert isinstance(failed, RequestOutput) and failed.finish_reason == "error"
    assert "rank 1" in (failed.error or "") and "bad regex" in (failed.error or "")
    assert gate.answer(GrammarReady(rank=0, ticket=tb)) is None  # settled: ignored
    assert not gate and gate.abort(["a", "b"]) == []


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


def test_slow_grammar_waits_alone_and_a_failing_one_fails_alone(
    tok_dir: str, tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = f"{tmp_path}/go"
    monkeypatch.setenv("TANDEM_TEST_GRAMMAR_HOLD", go)
    try:
        with LLM(model="dummy:micro", tokenizer=tok_dir, kv_cache_memory=16 * 2**20,
                 tensor_parallel_size=2, enable_checksum=True) as llm:
            client = llm.client
            assert client is not None
            spec = StructuredOutputsParams(choice=["yes", "no"])
            held_sp = llm._grammars().prepare(
                [SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=spec)])[0]
            held: Sink = queue.Queue()
            client.add_request("held", [5, 6, 7], held_sp, held)

            # the held compile must not stop this request's steps
            plain = llm.generate([[5, 6, 7]], PLAIN, use_tqdm=False, timeout_s=120)
            assert plain[0].finish_reason == "length" and len(plain[0].token_ids) == 4
            assert held.empty()  # still waiting: no token, no finish
            assert llm.health().num_waiting == 1

            open(go, "w").close()  # the grammar "finishes compiling" on every rank
            out = _finish(held)
            assert out.finish_reason == "stop", out.error
            assert llm.tokenizer is not None
            assert llm.tokenizer.decode(out.new_token_ids) in ("yes", "no")

            # past the frontend's check (straight to the engine): only the workers refuse it
            bad: Sink = queue.Queue()
            client.add_request("bad", [5, 6], SamplingParams(
                structured_outputs=StructuredOutputsParams(regex="[a-")), bad)
            plain = llm.generate([[5, 6, 7]], PLAIN, use_tqdm=False, timeout_s=120)
            failed = _finish(bad)
            assert plain[0].finish_reason == "length" and len(plain[0].token_ids) == 4
    finally:
        assert wait_no_descendants(20) == []
    assert failed.finish_reason == "error" and not failed.new_token_ids
    assert "worker rank" in (failed.error or "") and "regex" in (failed.error or ""), failed.error
