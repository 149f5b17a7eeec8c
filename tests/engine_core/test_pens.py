"""The engine core goes over its list of holding pens for every pen role, and names no feature.

No worker processes: an EngineCore with its sockets bound in a private directory, a scheduler
from fake_worker, and a dummy pen added to the list. The frontend's end of the output socket
is read here, so what the core flushes can be checked.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence

import msgspec
import pytest
import zmq

from engine_core.census import core_census
from engine_core.core import EngineCore
from engine_core.pens.base import HoldingPen, Settled
from engine_core.request import Request
from protocol.codec import Encoder, engine_decoder
from protocol.config import EngineConfig
from protocol.lora import LoRARequest
from protocol.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineOutputs,
    GrammarReady,
    LoadLoRA,
    LoRAResult,
)
from protocol.transport import ipc_endpoints, make_socket
from tests.engine_core.fake_worker import make_request, make_scheduler


class Poke(msgspec.Struct):
    """A reply for the dummy pen: release (or fail) one held request."""

    request_id: str
    fail: bool = False


class DummyPen(HoldingPen):
    name = "dummy"
    reply_types = (Poke,)

    def __init__(self) -> None:
        self.held: dict[str, Request] = {}
        self.calls: list[str] = []

    def hold(self, request: Request) -> bool | str:
        if request.request_id.startswith("refuse"):
            return "refused by the dummy pen"
        if not request.request_id.startswith("hold"):
            return False
        self.held[request.request_id] = request
        return True

    def on_reply(self, msg: msgspec.Struct) -> Settled:
        assert isinstance(msg, Poke)
        req = self.held.pop(msg.request_id)
        if msg.fail:
            return Settled(outputs=[EngineCoreOutput(request_id=req.request_id, new_token_ids=[],
                                                  finish_reason="error", error="dummy")])
        return Settled(admit=[req])

    def tick(self) -> Settled:
        self.calls.append("tick")
        return Settled()

    def abort(self, request_ids: Sequence[str]) -> list[EngineCoreOutput]:
        self.calls.append("abort")
        return [EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason="abort")
                for r in request_ids if self.held.pop(r, None) is not None]

    @property
    def num_held(self) -> int:
        return len(self.held)

    def census(self) -> dict[str, int]:
        return {"dummy.held": len(self.held)}

    def stats(self) -> dict[str, float]:
        return {"dummy_figure": 1.0}

    def close(self) -> None:
        self.calls.append("close")


@pytest.fixture
def core() -> Iterator[tuple[EngineCore, zmq.Socket[bytes]]]:
    endpoints, path = ipc_endpoints()
    core = EngineCore(EngineConfig(), endpoints, world_size=1)
    core.scheduler = make_scheduler()
    core.vocab_size, core.eos_token_id = 1000, None
    sink = make_socket(core.ctx, zmq.PULL, endpoints.outputs, bind=False, secret=None)
    try:
        yield core, sink
    finally:
        core.close()
        sink.close(0)
        shutil.rmtree(path, ignore_errors=True)


def received(sink: zmq.Socket[bytes], frames: int) -> list[msgspec.Struct]:
    """The next ``frames`` messages the core sent the frontend (the ipc hop is asynchronous;
    the wait only bounds a failing test)."""
    dec = engine_decoder()
    out = []
    for _ in range(frames):
        assert sink.poll(30_000), f"the core sent {len(out)} of {frames} messages: {out}"
        out.append(dec.decode(sink.recv()))
    return out


def admit(core: EngineCore, rid: str) -> None:
    core.inflight.add(rid)
    core._admit(make_request(rid, [1, 2, 3]))


def test_only_enabled_features_have_pens() -> None:
    # structured outputs have no switch: the grammar pen is always there
    for config, names in ((EngineConfig(), ["grammar"]),
                          (EngineConfig(enable_lora=True), ["lora", "grammar"])):
        endpoints, path = ipc_endpoints()
        core = EngineCore(config, endpoints, world_size=1)
        try:
            assert [p.name for p in core.pens] == names
        finally:
            core.close()
            shutil.rmtree(path, ignore_errors=True)


def test_core_goes_over_its_pens(core: tuple[EngineCore, zmq.Socket[bytes]]) -> None:
    eng, sink = core
    pen = DummyPen()
    eng.use_pens([*eng.pens, pen])

    admit(eng, "plain")  # passes every pen
    admit(eng, "hold-a")
    admit(eng, "hold-b")
    admit(eng, "hold-c")
    admit(eng, "refuse-d")
    assert set(eng.scheduler.requests) == {"plain"}
    assert set(pen.held) == {"hold-a", "hold-b", "hold-c"}
    assert eng.num_waiting() == 1 + 3
    assert "refuse-d" not in eng.inflight

    # the link keeps the replies of every pen's types in one list, in arrival order; the core
    # routes each by its type (a GrammarReady for no ticket: the grammar pen ignores it)
    stale = GrammarReady(rank=0, ticket=12345)
    assert eng.link.decode(Encoder().encode(stale)) == stale
    eng.link.replies += [Poke("hold-a"), Poke("hold-b", fail=True)]
    assert eng.link.replies == [stale, Poke("hold-a"), Poke("hold-b", fail=True)]
    eng._settle_pens()
    assert eng.link.replies == []
    assert "hold-a" in eng.scheduler.requests and pen.calls == ["tick"]

    census = core_census(eng)
    assert census["dummy.held"] == 1 and census["grammar_gate.held"] == 0
    assert eng._health(0).stats["dummy_figure"] == 1.0

    eng._handle_frontend(Encoder().encode(AbortRequests(["hold-c"])))
    assert "abort" in pen.calls and pen.num_held == 0

    # LoRA is not enabled: its control messages still get an answer
    lora = LoRARequest("a1", 1, "/nowhere")
    eng._handle_frontend(Encoder().encode(LoadLoRA(lora, call_id=7)))

    # the refusal, the failed release, the abort and the LoRA answer
    got = received(sink, 4)
    outs = {o.request_id: o for m in got if isinstance(m, EngineOutputs) for o in m.outputs}
    assert outs["refuse-d"].error == "refused by the dummy pen"
    assert outs["hold-b"].error == "dummy"
    assert outs["hold-c"].finish_reason == "abort"
    (answer,) = [m for m in got if isinstance(m, LoRAResult)]
    assert answer.call_id == 7 and "--enable-lora" in answer.error

    eng.close()
    assert pen.calls[-1] == "close"
