"""Adapter load / unload answers reach the call that asked, by call id: a caller that gave up
(its timeout passed) must not hand its late answer to the next caller of the same adapter.

The EngineClient runs for real over ZeroMQ; the engine core's side is played by this test on
the same sockets, so it can answer out of order and late."""

from __future__ import annotations

import threading

import pytest
import zmq

from launch.client import EngineClient
from protocol.codec import Encoder, frontend_decoder
from protocol.lora import LoRARequest
from protocol.messages import LoadLoRA, LoRAResult, UnloadLoRA
from protocol.transport import ipc_endpoints, make_socket, recv_frame, remove_ipc_dir


@pytest.fixture
def core():
    eps, path = ipc_endpoints()
    ctx = zmq.Context.instance()
    pull = make_socket(ctx, zmq.PULL, eps.requests, bind=True)
    push = make_socket(ctx, zmq.PUSH, eps.outputs, bind=True)
    client = EngineClient(eps)
    try:
        yield client, pull, push
    finally:
        client.close()
        pull.close(0)
        push.close(0)
        remove_ipc_dir(path)


def _next(pull: zmq.Socket) -> LoadLoRA | UnloadLoRA:
    frame = recv_frame(pull, 5000)
    assert frame is not None, "no ask from the client in 5 s"
    msg = frontend_decoder().decode(frame)
    assert isinstance(msg, (LoadLoRA, UnloadLoRA))
    return msg


def test_a_late_answer_goes_to_nobody(core) -> None:
    client, pull, push = core
    enc = Encoder()
    lora = LoRARequest("sql", 1, "/adapters/sql")
    with pytest.raises(TimeoutError):
        client.load_lora(lora, timeout_s=0.2)  # the core has not answered: the caller gives up
    first = _next(pull)
    got: list[LoRAResult] = []
    second = threading.Thread(target=lambda: got.append(client.load_lora(lora, timeout_s=10)))
    second.start()
    ask = _next(pull)
    assert ask.call_id != first.call_id
    # the first ask's late refusal, then the second's success: the second caller must see its
    # own answer, not the refusal meant for a caller that is gone
    push.send(enc.encode(LoRAResult(lora_name="sql", error="refused", call_id=first.call_id)))
    push.send(enc.encode(LoRAResult(lora_name="sql", call_id=ask.call_id)))
    second.join(10)
    assert got == [LoRAResult(lora_name="sql", call_id=ask.call_id)]
    assert client.census()["client.lora_calls"] == 0


def test_concurrent_calls_get_their_own_answers(core) -> None:
    client, pull, push = core
    enc = Encoder()
    results: dict[str, LoRAResult] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__(
            "load", client.load_lora(LoRARequest("a", 1, "/a"), timeout_s=10))),
        threading.Thread(target=lambda: results.__setitem__(
            "unload", client.unload_lora("a", timeout_s=10))),
    ]
    for t in threads:
        t.start()
    asks = [_next(pull), _next(pull)]
    for ask in reversed(asks):  # answered in the other order
        kind = "load" if isinstance(ask, LoadLoRA) else "unload"
        push.send(enc.encode(LoRAResult(lora_name="a", error=kind, call_id=ask.call_id)))
    for t in threads:
        t.join(10)
    assert results["load"].error == "load" and results["unload"].error == "unload"
