"""Fuzzing every decoder: whatever the bytes, the only failure is ProtocolError.

A receiver must be able to report a bad frame and carry on, so a decoder that raised anything
else (IndexError, UnicodeDecodeError, SystemError, ...) would bring a process down.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import messages as m
from protocol.codec import (
    HEADER,
    MAGIC,
    Decoder,
    Encoder,
    ProtocolError,
    broadcast_decoder,
    engine_decoder,
    frontend_decoder,
    unpack,
    worker_decoder,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wire_samples import SAMPLES  # noqa: E402

DECODERS: list[Decoder] = [
    frontend_decoder(),
    engine_decoder(),
    broadcast_decoder(),
    worker_decoder(),
]
ENC = Encoder()
VALID_FRAMES = [
    ENC.encode(m.EngineOutputs(outputs=[s], timestamp=1.0))  # only travels inside EngineOutputs
    if isinstance(s, m.EngineCoreOutput)
    else ENC.encode(s)
    for s in SAMPLES
]


FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_everywhere(frame: bytes) -> None:
    for dec in DECODERS:
        try:
            msg = dec.decode(frame)
        except ProtocolError:
            continue
        # a frame that decodes must also be safe to read: packed fields unpack or ProtocolError
        _touch_packed(msg)


def _touch_packed(msg: msgspec.Struct) -> None:
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if isinstance(value, bytes) and name not in ("auth", "logprobs"):
            try:
                unpack(value)
            except ProtocolError:
                pass
        elif isinstance(value, msgspec.Struct):
            _touch_packed(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, msgspec.Struct):
                    _touch_packed(item)


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    _decode_everywhere(data)


@FUZZ
@given(st.binary(max_size=512))
def test_random_body_behind_a_valid_header(body: bytes) -> None:
    _decode_everywhere(HEADER + body)


@FUZZ
@given(
    st.sampled_from(VALID_FRAMES),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_mutated_valid_frames(frame: bytes, edits: list[tuple[int, int]]) -> None:
    buf = bytearray(frame)
    for pos, byte in edits:
        buf[2 + pos % max(1, len(buf) - 2)] = byte  # keep the header so the body is exercised
    _decode_everywhere(bytes(buf))


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.data())
def test_truncated_frames(frame: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(frame) - 1))
    for dec in DECODERS:
        with pytest.raises(ProtocolError):
            dec.decode(frame[:cut])


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.integers(0, 255), st.binary(min_size=1, max_size=64))
def test_inserted_and_appended_bytes(frame: bytes, pos: int, extra: bytes) -> None:
    at = 2 + pos % (len(frame) - 1)
    _decode_everywhere(frame[:at] + extra + frame[at:])
    for dec in DECODERS:  # trailing garbage after a complete message is rejected
        with pytest.raises(ProtocolError):
            dec.decode(frame + extra)


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.integers(0, 255))
def test_wrong_magic(frame: bytes, magic: int) -> None:
    if magic == MAGIC:
        return
    for dec in DECODERS:
        with pytest.raises(ProtocolError, match="magic"):
            dec.decode(bytes([magic]) + frame[1:])


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.integers(0, 255))
def test_wrong_version(frame: bytes, version: int) -> None:
    if version == m.PROTOCOL_VERSION:
        return
    for dec in DECODERS:
        with pytest.raises(ProtocolError, match="version"):
            dec.decode(frame[:1] + bytes([version]) + frame[2:])


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.integers(3, 64))
def test_oversized_frames(frame: bytes, limit: int) -> None:
    small = [
        frontend_decoder(limit),
        engine_decoder(limit),
        broadcast_decoder(limit),
        worker_decoder(limit),
    ]
    for dec in small:
        if len(frame) > limit:
            with pytest.raises(ProtocolError, match="exceeds"):
                dec.decode(frame)
        else:
            try:
                dec.decode(frame)
            except ProtocolError:
                pass


@pytest.mark.parametrize(
    "body",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items, nothing behind
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
        b"\x91" * 10_000 + b"\x00",  # deep nesting
        b"\x92\x7f\x00",  # unknown tag 127
        b"\x92\x14" + b"\xc6\xff\xff\xff\xff",  # bin32 length past the end
        b"\xc1",  # never-used msgpack byte
    ],
)
def test_hostile_bodies(body: bytes) -> None:
    for dec in DECODERS:
        with pytest.raises(ProtocolError):
            dec.decode(HEADER + body)


@pytest.mark.parametrize("body", [b"\x92\x02\x91\xa1\x80", b"\x92\x02\x91\xa2\xff\xfe"])
def test_invalid_utf8_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        frontend_decoder().decode(HEADER + body)


def test_valid_frames_still_decode() -> None:
    # sanity: the fuzz corpus itself is valid for exactly one decoder each
    for frame in VALID_FRAMES:
        ok = 0
        for dec in DECODERS:
            try:
                dec.decode(frame)
                ok += 1
            except ProtocolError:
                pass
        assert ok == 1
