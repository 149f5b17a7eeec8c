"""A constrained request waits outside the scheduler until every rank compiled its grammar.

Real processes, real xgrammar. A test-only hook (TANDEM_TEST_GRAMMAR_HOLD) keeps the workers'
compiles waiting until a file exists, so the test decides when a grammar is "slow" without any
timing: the unconstrained request must finish while the constrained one still waits. A grammar
the workers cannot compile (sent past the frontend's own check) fails only its request.
"""

from __future__ import annotations

import queue
from typing import Any

import pytest

from engine_core.grammar.gate import GrammarGate
from engine_core.request import Request, RequestStatus
from launch import LLM, SamplingParams, StructuredOutputsParams
from launch.client import Sink
from protocol.config import EngineConfig
from protocol.messages import DropGrammars, EngineCoreOutput, GrammarReady
from tests.helpers.procs import wait_no_descendants
from tests.serve.serve_helpers import make_tokenizer_dir

PLAIN = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _finish(sink: Sink, timeout_s: float = 120.0) -> EngineCoreOutput:
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
    assert isinstance(failed, EngineCoreOutput) and failed.finish_reason == "error"
    assert "rank 1" in (failed.error or "") and "bad regex" in (failed.error or "")
    assert gate.answer(GrammarReady(rank=0, ticket=tb)) is None  # settled: ignored
    assert not gate and gate.abort(["a", "b"]) == []


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(rid: str, i: int) -> Request:
    spec = StructuredOutputsParams(regex=f"x{i}")
    return Request(rid, [1], SamplingParams(structured_outputs=spec), 2, 0.0)


def _ready(gate: GrammarGate, ticket: int, size: int) -> Request | EngineCoreOutput | None:
    gate.answer(GrammarReady(rank=0, ticket=ticket, size_bytes=size))
    return gate.answer(GrammarReady(rank=1, ticket=ticket, size_bytes=size))


def test_gate_keeps_the_ranks_grammars_to_the_budget_least_recently_used_first() -> None:
    sent: list[Any] = []
    gate = GrammarGate(2, EngineConfig(structured_outputs_cache_mb=1), publish=sent.append)
    mb = 2**20
    reqs = [_request(f"r{i}", i) for i in range(4)]
    msgs = [gate.hold(r) for r in reqs[:3]]
    assert len({m.grammar_id for m in msgs}) == 3
    for m, r in zip(msgs, reqs, strict=False):
        assert _ready(gate, m.ticket, mb // 2) is r
    assert sent == []  # 1.5 MiB, but every grammar is held by a live request
    reqs[1].status = reqs[0].status = RequestStatus.FINISHED_STOPPED
    again = gate.hold(_request("r0b", 0))  # r0's key again: used, so now the newest
    assert again.grammar_id == msgs[0].grammar_id
    assert sent == [DropGrammars([msgs[1].grammar_id])]  # the least recently used unheld
    assert gate.stats()["grammar_cache_bytes"] == mb and gate.evictions == 1
    m3 = gate.hold(reqs[3])
    assert isinstance(_ready(gate, m3.ticket, mb // 2), Request)
    assert len(sent) == 1  # r0b and r2, r3 hold theirs: over budget, nothing evictable


def test_gate_times_out_a_ticket_once_for_every_rank_and_drops_its_grammar() -> None:
    sent: list[Any] = []
    clock = Clock()
    gate = GrammarGate(2, EngineConfig(structured_outputs_compile_timeout=10.0),
                       publish=sent.append, clock=clock)
    cold = gate.hold(_request("cold", 0))
    clock.now = 100.0  # the ranks are still loading their grammar engine: no clock yet
    assert gate.expire() == []
    gate.answer(GrammarReady(rank=0, ticket=cold.ticket))
    assert gate.answer(GrammarReady(rank=1, ticket=cold.ticket)) is not None  # warm now
    slow = gate.hold(_request("slow", 1))
    gate.answer(GrammarReady(rank=1, ticket=slow.ticket))
    clock.now = 109.9
    assert gate.expire() == []
    clock.now = 110.0
    [out] = gate.expire()
    assert out.request_id == "slow" and out.finish_reason == "error"
    assert "within 10 s" in (out.error or "") and "ranks [0]" in (out.error or "")
    assert "--structured-outputs-compile-timeout" in (out.error or "")
    assert sent == [DropGrammars([slow.grammar_id])]  # never compiled everywhere: dropped
    assert gate.answer(GrammarReady(rank=0, ticket=slow.ticket)) is None  # settled: ignored
    assert not gate and gate.stats()["grammar_compile_timeouts"] == 1
    aborted = gate.hold(_request("gone", 2))
    assert [o.finish_reason for o in gate.abort(["gone"])] == ["abort"]
    assert sent[-1] == DropGrammars([aborted.grammar_id])
    failed = gate.hold(_request("bad", 3))
    assert gate.answer(GrammarReady(rank=1, ticket=failed.ticket, error="no")) is not None
    assert sent[-1] == DropGrammars([failed.grammar_id])


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
