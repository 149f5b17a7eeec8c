"""Every wire message survives encode -> decode unchanged, through the decoder of its direction."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import messages as m
from protocol.codec import (
    Encoder,
    ProtocolError,
    broadcast_decoder,
    engine_decoder,
    frontend_decoder,
    pack,
    pack_f32,
    unpack,
    unpack_f32,
    unpack_np,
    worker_decoder,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wire_samples import SAMPLES  # noqa: E402

DECODERS = {
    "frontend": (frontend_decoder(), m.FrontendMessage),
    "engine": (engine_decoder(), m.EngineMessage),
    "broadcast": (broadcast_decoder(), m.WorkerBroadcast),
    "worker": (worker_decoder(), m.WorkerMessage),
}


def _framed(msg: msgspec.Struct) -> msgspec.Struct:
    # EngineCoreOutput only travels inside EngineOutputs
    if isinstance(msg, m.EngineCoreOutput):
        return m.EngineOutputs(outputs=[msg], timestamp=0.0)
    return msg


def _direction(msg: msgspec.Struct) -> str:
    for name, (_, union) in DECODERS.items():
        if type(msg) in typing.get_args(union):
            return name
    raise AssertionError(f"{type(msg).__name__} belongs to no wire direction")


def test_samples_cover_every_message_type() -> None:
    every = {t for _, union in DECODERS.values() for t in typing.get_args(union)}
    every.add(m.EngineCoreOutput)
    assert every == {type(s) for s in SAMPLES}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip(msg: msgspec.Struct) -> None:
    msg = _framed(msg)
    frame = Encoder().encode(msg)
    dec, _ = DECODERS[_direction(msg)]
    out = dec.decode(frame)
    assert type(out) is type(msg)
    assert out == msg
    assert dec.decode(memoryview(frame)) == msg  # zero-copy input works too


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: type(s).__name__)
def test_wrong_direction_is_a_protocol_error(msg: msgspec.Struct) -> None:
    msg = _framed(msg)
    frame = Encoder().encode(msg)
    own = _direction(msg)
    for name, (dec, _) in DECODERS.items():
        if name != own:
            with pytest.raises(ProtocolError):
                dec.decode(frame)


def test_encoder_reuse_does_not_alias_frames() -> None:
    enc = Encoder()
    a = enc.encode(m.HealthPing(nonce=1))
    b = enc.encode(m.Shutdown(reason="a much longer reason than before"))
    assert broadcast_decoder().decode(a) == m.HealthPing(nonce=1)
    assert isinstance(broadcast_decoder().decode(b), m.Shutdown)


def test_steady_decode_step_is_tiny() -> None:
    # the diff must not grow with the batch: nobody arrives, leaves or gets a block
    frame = Encoder().encode(
        m.SchedulerOutput(step_id=123456, num_running=256, total_num_scheduled_tokens=256)
    )
    assert len(frame) < 64


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300))
def test_pack_round_trip(values: list[int]) -> None:
    data = pack(values)
    narrow = all(0 <= v <= 0xFFFF for v in values)
    assert len(data) == (0 if not values else 1 + (2 if narrow else 4) * len(values))
    assert unpack(data) == values
    assert unpack_np(data).tolist() == values


@given(st.lists(st.floats(width=32, allow_nan=False), max_size=100))
def test_pack_f32_round_trip(values: list[float]) -> None:
    assert unpack_f32(pack_f32(values)) == values


def test_pack_is_little_endian_and_numpy_compatible() -> None:
    np = pytest.importorskip("numpy")
    assert pack([1, -1]) == b"\x04\x01\x00\x00\x00\xff\xff\xff\xff"
    assert pack([1, 65535]) == b"\x02\x01\x00\xff\xff"  # narrow values take two bytes
    arr = np.array([3, 4, 5], dtype=np.int64)
    assert pack(arr) == pack([3, 4, 5])
    assert pack(np.array([70000, 1])) == pack([70000, 1])
    assert np.frombuffer(pack([7, 8]), dtype="<u2", offset=1).tolist() == [7, 8]


def test_unpack_rejects_ragged_bytes() -> None:
    with pytest.raises(ProtocolError):
        unpack(b"\x04\x01\x02")  # int32 width, 2 bytes
    with pytest.raises(ProtocolError):
        unpack(b"\x03\x01\x02\x03")  # unknown width
    with pytest.raises(ProtocolError):
        unpack_f32(b"\x00")
