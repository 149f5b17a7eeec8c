"""KV cache events: the block pool's sink that collects them, and the publisher that sends them
(wire format in protocol/kv_events.py).

The engine core's step pays for collecting (a list append per cached or evicted block, only
when events are on) and for one hand-over per step that had any: the batch goes onto a
bounded queue and a publisher thread encodes it (msgpack), numbers it, sends it and keeps it
for replays. A full queue drops its oldest batch and counts it; its sequence number is then
missing on the wire, so a subscriber sees the gap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from engine_core.kv_cache.block_pool import KVEventSink
from protocol.kv_events import (
    ALL_BLOCKS_CLEARED,
    END_SEQ,
    SEQ_BYTES,
    KVEventsConfig,
    block_removed,
    block_stored,
    external_hash,
)

if TYPE_CHECKING:
    from engine_core.kv_cache.block import KVCacheBlock
    from engine_core.request import BlockHash, Request
    from engine_core.sched.scheduler import Scheduler

logger = logging.getLogger("tandem.kv_events")


class EventCollector(KVEventSink):
    """The pool's events since the last step, coalesced: a run of one request's new blocks is
    one BlockStored, a run of removals one BlockRemoved. Only the full-attention group 0 is
    reported: its hash chain is the prefix a router indexes."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[dict[str, Any]] = []

    def stored(self, request: Request, blocks: list[KVCacheBlock], start: int, end: int,
               group_id: int) -> None:
        if group_id != 0 or start >= end:
            return
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        lora_id = request.lora_int_id or None
        run: dict[str, Any] | None = None
        for i in range(start, end):
            h = hashes[i]
            if blocks[i].block_hash != h:  # not registered: another block holds this prefix
                run = None
                continue
            if run is None:
                parent = external_hash(hashes[i - 1]) if i > 0 else None
                run = block_stored([], parent, [], bs, lora_id)
                self.events.append(run)
            run["block_hashes"].append(external_hash(h))
            run["token_ids"].extend(tokens[i * bs:(i + 1) * bs])

    def removed(self, key: BlockHash) -> None:
        if type(key) is tuple:  # another group's block
            return
        events = self.events
        if events and events[-1]["type"] == "BlockRemoved":
            events[-1]["block_hashes"].append(external_hash(key))
        else:
            events.append(block_removed([external_hash(key)]))

    def evicting(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            if block.block_hash is not None:
                self.removed(block.block_hash)

    def cleared(self) -> None:
        self.events.append(dict(ALL_BLOCKS_CLEARED))

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


class NoEventPublisher:
    """Events off: the engine core's per-step call costs nothing else."""

    dropped = 0

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_PUBLISHER = NoEventPublisher()


class KVEventPublisher(NoEventPublisher):
    def __init__(self, config: KVEventsConfig, block_size: int,
                 ctx: zmq.Context[zmq.Socket[bytes]] | None = None, start: bool = True) -> None:
        self.config = config
        self.collector = EventCollector(block_size)
        self.ctx = ctx or zmq.Context.instance()
        self._queue: deque[tuple[int, float, list[dict[str, Any]]]] = deque()
        self._lock = threading.Lock()
        self._next_seq = 0
        self.dropped = 0  # batches dropped because the queue was full
        self._stop = False
        # the sockets live on the publisher thread; bind here so a bad address fails start-up
        self._pub = self.ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint:
            self._replay = self.ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        # a wake-up pipe: the thread sleeps in zmq.poll on it and the replay socket
        addr = f"inproc://tandem-kv-events-{id(self)}"
        self._wake_rx = self.ctx.socket(zmq.PAIR)
        self._wake_rx.bind(addr)
        self._wake_tx = self.ctx.socket(zmq.PAIR)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(addr)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        if start:  # (tests hold it back to see the queue fill)
            self._thread.start()

    # ------------------------------------------------------------------ engine core thread

    def end_step(self) -> None:
        """Hand this step's events to the publisher thread (once per step)."""
        if not self.collector.events:
            return
        events = self.collector.take()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if len(self._queue) >= self.config.max_queue_size:
                self._queue.popleft()
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # 1, 2, 4, ...: a warning, no flood
                    logger.warning("KV events: %d batches dropped (publisher queue full)",
                                   self.dropped)
            self._queue.append((seq, time.time(), events))
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake-up is already pending

    def close(self) -> None:
        self.end_step()  # what the last step collected
        self._stop = True
        try:
            self._wake_tx.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._wake_tx.close()
        if not self._thread.is_alive():
            for s in (self._pub, self._replay, self._wake_rx):
                if s is not None:
                    s.close()

    # ------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        topic = self.config.topic.encode()
        buffer: deque[tuple[bytes, bytes]] = deque(maxlen=self.config.buffer_steps)
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(1000))
            if self._wake_rx in ready:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            with self._lock:
                batches = list(self._queue)
                self._queue.clear()
            for seq, ts, events in batches:
                seq_bytes = seq.to_bytes(SEQ_BYTES, "big")
                payload = encode([ts, events])
                try:
                    self._pub.send_multipart((topic, seq_bytes, payload), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # past the high-water mark: subscribers replay it
                buffer.append((seq_bytes, payload))
            if self._replay is not None and self._replay in ready:
                self._serve_replays(buffer)
            if self._stop:
                return

    def _serve_replays(self, buffer: deque[tuple[bytes, bytes]]) -> None:
        """[start_seq] -> every buffered batch from start_seq as [seq, payload], then
        [END_SEQ, b""]."""
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # a REQ peer's frames carry an empty delimiter, a DEALER's need not: answer alike
            if len(frames) not in (2, 3) or len(frames[-1]) != SEQ_BYTES:
                continue  # not a replay request: ignored, the peer is not trusted
            head = (frames[0], b"") if len(frames) == 3 else (frames[0],)
            start = int.from_bytes(frames[-1], "big")
            for seq_bytes, payload in buffer:
                if int.from_bytes(seq_bytes, "big") >= start:
                    self._replay.send_multipart((*head, seq_bytes, payload))
            self._replay.send_multipart((*head, END_SEQ, b""))


def attach_kv_events(config: Any, scheduler: Scheduler) -> NoEventPublisher:
    """The engine's publisher, its collector installed in the block pool (events on), or one
    that does nothing (off)."""
    cfg: KVEventsConfig | None = getattr(config, "kv_events_config", None)
    if cfg is None or not cfg.active:
        return NoEventPublisher()
    kvm = scheduler.kv_cache_manager
    pub = KVEventPublisher(cfg, kvm.block_size)
    kvm.block_pool.events = pub.collector
    logger.info("KV cache events on %s (replay %s)", cfg.endpoint, cfg.replay_endpoint)
    return pub
