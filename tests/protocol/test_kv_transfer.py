"""KVTransfers / KVLoadResult: round trips through the codec, malformed contents rejected with
ProtocolError, and arbitrary bytes never raise anything else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import HEADER, Decoder, Encoder, ProtocolError, pack, unpack
from protocol.kv_transfer import (
    KVLoadResult,
    KVTransfers,
    decode_transfers,
    is_empty,
    pack_pairs,
    pack_tags,
    unpack_pairs,
    unpack_tags,
)

ENC = Encoder()
DEC: Decoder[KVTransfers] = Decoder(KVTransfers)
RES_DEC: Decoder[KVLoadResult] = Decoder(KVLoadResult)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

ids = st.integers(0, 2**31 - 1)
small_ids = st.integers(0, 70_000)  # crosses the uint16 / int32 packing boundary
tags = st.integers(0, 2**64 - 1)


def unique_dst_pairs(id_strategy: st.SearchStrategy[int]) -> st.SearchStrategy:
    return st.lists(st.tuples(id_strategy, id_strategy), max_size=40,
                    unique_by=lambda p: p[1])


@st.composite
def transfers(draw: st.DrawFn) -> tuple[dict[str, list], KVTransfers]:
    idst = draw(st.sampled_from([ids, small_ids]))
    plain = {name: draw(unique_dst_pairs(idst))
             for name in ("host_to_disk", "disk_to_host", "device_to_host", "host_to_device")}
    plain["host_to_disk_tags"] = draw(st.lists(tags, min_size=len(plain["host_to_disk"]),
                                               max_size=len(plain["host_to_disk"])))
    plain["disk_to_host_tags"] = draw(st.lists(tags, min_size=len(plain["disk_to_host"]),
                                               max_size=len(plain["disk_to_host"])))
    wire = KVTransfers(
        host_to_disk=pack_pairs(plain["host_to_disk"]),
        disk_to_host=pack_pairs(plain["disk_to_host"]),
        device_to_host=pack_pairs(plain["device_to_host"]),
        host_to_device=pack_pairs(plain["host_to_device"]),
        host_to_disk_tags=pack_tags(plain["host_to_disk_tags"]),
        disk_to_host_tags=pack_tags(plain["disk_to_host_tags"]),
    )
    return plain, wire


@FUZZ
@given(transfers())
def test_round_trip(case: tuple[dict[str, list], KVTransfers]) -> None:
    plain, wire = case
    got = DEC.decode(ENC.encode(wire))
    assert got == wire
    decoded = decode_transfers(got)
    for name, value in plain.items():
        assert getattr(decoded, name) == value, name
    assert len(decoded) == sum(len(plain[k]) for k in plain if not k.endswith("tags"))
    assert is_empty(got) == (len(decoded) == 0)


def test_empty_is_a_few_bytes() -> None:
    # a step without copies carries None in the step plan; an empty struct is still tiny
    # (array_like structs keep their fields: 1 byte per empty bin)
    assert len(ENC.encode(KVTransfers())) <= 16
    assert is_empty(KVTransfers())


def test_size_grows_with_copies_not_pool() -> None:
    # two copies between huge ids: a handful of bytes per pair, whatever the pool size
    frame = ENC.encode(KVTransfers(device_to_host=pack_pairs([(1_000_000, 5), (7, 2_000_000)])))
    assert len(frame) < 40


@FUZZ
@given(st.lists(small_ids, max_size=40), st.lists(small_ids, max_size=40))
def test_load_result_round_trip(done: list[int], failed: list[int]) -> None:
    r = KVLoadResult(done_host_slots=pack(done), failed_host_slots=pack(failed))
    got = RES_DEC.decode(ENC.encode(r))
    assert unpack(got.done_host_slots) == done and unpack(got.failed_host_slots) == failed


@pytest.mark.parametrize(
    "bad, match",
    [
        (KVTransfers(device_to_host=pack([1, 2, 3])), "odd number"),
        (KVTransfers(host_to_device=pack([-1, 2])), "negative"),
        (KVTransfers(host_to_disk=pack_pairs([(1, 2)])), "tags"),
        (KVTransfers(disk_to_host=pack_pairs([(1, 2)]), disk_to_host_tags=pack_tags([1, 2])),
         "tags"),
        (KVTransfers(host_to_device=pack_pairs([(1, 2), (3, 2)])), "twice"),
        (KVTransfers(device_to_host=b"\x03\x00\x00\x00"), "malformed"),
        (KVTransfers(host_to_disk=pack_pairs([(1, 2)]), host_to_disk_tags=b"\x00" * 7),
         "multiple of 8"),
    ],
)
def test_malformed_contents_are_protocol_errors(bad: KVTransfers, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode_transfers(DEC.decode(ENC.encode(bad)))


def test_pairs_and_tags_helpers() -> None:
    assert unpack_pairs(b"") == [] and unpack_tags(b"") == []
    assert unpack_pairs(pack_pairs([(0, 65_536)])) == [(0, 65_536)]
    assert unpack_tags(pack_tags([0, 2**64 - 1])) == [0, 2**64 - 1]


def _decode_everything(frame: bytes) -> None:
    for dec in (DEC, RES_DEC):
        try:
            msg = dec.decode(frame)
        except ProtocolError:
            continue
        try:
            if isinstance(msg, KVTransfers):
                decode_transfers(msg)
            else:
                unpack(msg.done_host_slots)
                unpack(msg.failed_host_slots)
        except ProtocolError:
            pass


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    _decode_everything(HEADER + data)
    _decode_everything(data)


@FUZZ
@given(transfers(), st.data())
def test_fuzz_mutated_frames(case: tuple[dict[str, list], KVTransfers],
                             data: st.DataObject) -> None:
    frame = bytearray(ENC.encode(case[1]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    _decode_everything(bytes(frame[:cut]))
    _decode_everything(bytes(frame))


def test_struct_is_array_like() -> None:
    # no field names on the wire, like every other message
    raw = msgspec.msgpack.encode(KVTransfers(device_to_host=pack_pairs([(1, 2)])))
    assert b"device_to_host" not in raw
