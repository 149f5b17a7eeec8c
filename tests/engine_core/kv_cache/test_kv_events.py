"""KV cache events without an engine: the block pool's sink sees what is cached, evicted and
cleared; the publisher numbers batches from 0, binds the exact endpoint, replays from a
sequence number, and drops the oldest batch (counted) when its queue is full. Every batch is
read back with the wire decoder in tests/helpers/kv_events_wire.py."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.events import EventCollector, KVEventPublisher
from protocol.kv_events import END_SEQ, KVEventsConfig, external_hash, parse_kv_events_config
from tests.helpers.kv_events_wire import check_event, decode_batch

BS = 4


def request(tokens: list[int]) -> Any:
    hashes = [bytes([i + 1]) * 32 for i in range(len(tokens) // BS)]
    return SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_int_id=0)


def test_sink_reports_stored_removed_cleared() -> None:
    pool = BlockPool(4, num_groups=1)
    sink = EventCollector(BS)
    pool.events = sink
    req = request(list(range(100, 112)))  # 3 full blocks
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.cache_full_blocks(req, blocks, 2, 3)
    stored = [check_event(e) for e in sink.take()]
    assert [e["type"] for e in stored] == ["BlockStored", "BlockStored"]
    h = [external_hash(x) for x in req.block_hashes]
    assert stored[0]["block_hashes"] == h[:2] and stored[0]["parent_block_hash"] is None
    assert stored[0]["token_ids"] == list(range(100, 108))
    assert stored[1]["block_hashes"] == [h[2]] and stored[1]["parent_block_hash"] == h[1]
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)  # reuses the two least recently freed: evicted
    removed = [check_event(e) for e in sink.take()]
    assert removed == [{"type": "BlockRemoved", "block_hashes": h[:2], "medium": "GPU"}]
    pool.free_blocks(pool.blocks[1:3])
    assert pool.reset_prefix_cache()
    assert sink.take() == [{"type": "AllBlocksCleared"}]


def test_flag_parses_vllms_json() -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                 '"endpoint": "tcp://127.0.0.1:1", "topic": "kv", '
                                 '"some_other_vllm_key": 3}')
    assert cfg.active and cfg.topic == "kv"
    with pytest.raises(ValueError, match="publisher"):
        parse_kv_events_config('{"publisher": "kafka"}')


def _recv(sock: zmq.Socket[bytes], timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "no batch within the timeout"
    return sock.recv_multipart()


def test_publisher_numbers_from_zero_and_replays(tmp_path: Any) -> None:
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=ep,
                         replay_endpoint=rep, topic="t")
    pub = KVEventPublisher(cfg, BS, zmq.Context.instance())
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)  # the publisher bound the exact address: a subscriber connects
    req = ctx.socket(zmq.DEALER)  # a replay answers with several messages
    req.connect(rep)
    try:
        # a PUB drops what it sends before the subscription arrives: publish until one lands
        deadline = time.monotonic() + 10
        first = None
        while first is None:
            assert time.monotonic() < deadline, "subscriber never joined"
            pub.collector.cleared()
            pub.end_step()
            if sub.poll(100):
                first = decode_batch(sub.recv_multipart()).seq
        for _ in range(3):
            pub.collector.cleared()
            pub.end_step()
        seqs = [first]
        while len(seqs) < 4:
            b = decode_batch(_recv(sub))
            assert b.topic == b"t" and b.events == [{"type": "AllBlocksCleared"}]
            seqs.append(b.seq)
        assert seqs == list(range(first, first + 4))  # rising by 1, no gap
        # the replay from 0 fills in what the subscriber missed while joining
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            empty, seq, payload = _recv(req)
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append(decode_batch([b"t", seq, payload]).seq)
        assert replayed == list(range(first + 4))
    finally:
        pub.close()
        sub.close(linger=0)
        req.close(linger=0)


def test_full_queue_drops_the_oldest_and_counts() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                         endpoint="inproc://kv-events-drop", max_queue_size=2)
    pub = KVEventPublisher(cfg, BS, zmq.Context.instance(), start=False)  # nothing drains
    try:
        for _ in range(3):
            pub.collector.cleared()
            pub.end_step()
        assert pub.dropped == 1 and [seq for seq, _, _ in pub._queue] == [1, 2]
        pub.end_step()  # no events this step: nothing queued
        assert len(pub._queue) == 2
    finally:
        pub.close()
