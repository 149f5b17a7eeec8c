"""A prefill rank's block server: answers decode ranks on its own thread, so serving KV never
waits for (or delays) this rank's steps.

It serves only blocks under a lease the engine core exposed in a step diff, and only to a
reader presenting that lease's key (128 random bits the prefill answer carries: a capability),
and only the blocks that lease holds (``PEER_REFUSED`` otherwise, for the TCP pull and for the
shared-memory and NIXL readers' checks alike). It refuses (``PEER_GONE``) once the lease ended:
a block read after that may hold another request's KV.
Leases are the core's decision; this rank only follows the diff. For the TCP pull it gathers
the asked heads of the asked blocks into one buffer and sends it; shared memory and NIXL
readers only ask whether the lease still holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import zmq

from protocol.codec import Encoder, ProtocolError, unpack
from protocol.kv_peer import (
    PEER_CHECK,
    PEER_ERROR,
    PEER_GONE,
    PEER_NOT_YET,
    PEER_OK,
    PEER_REFUSED,
    PeerHello,
    PeerInfo,
    PeerRead,
    PeerReply,
    peer_decoder,
)
from protocol.transport import make_socket

logger = logging.getLogger("tandem.kv_connector")

GONE_MEMORY = 4096  # ended leases remembered, to answer "gone" rather than "not yet"
POLL_MS = 100
# with NIXL, how long after a decode rank's question the server keeps driving NIXL's progress
# (a one-sided read follows it at once), and how often
HOT_S = 2.0
HOT_POLL_MS = 1


class BlockServer:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], addr: str, secret: bytes | None,
                 caches: Sequence[torch.Tensor], info: PeerInfo,
                 progress: Callable[[], None] | None = None) -> None:
        self.sock = make_socket(ctx, zmq.ROUTER, addr, bind=True, secret=secret)
        endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(endpoint, bytes)
        self.port = int(endpoint.decode().rsplit(":", 1)[1])
        self.caches = list(caches)
        self.info = info
        self.progress = progress  # NIXL's, when readers may read this rank's memory with it
        self._hot_until = 0.0
        self._lock = threading.Lock()
        self._exposed: dict[str, frozenset[int]] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._stop = threading.Event()
        self._encoder = Encoder()
        self._decoder = peer_decoder()
        self.stream = torch.cuda.Stream(caches[0].device) if caches[0].is_cuda else None
        self.thread = threading.Thread(target=self._run, name="tandem-kv-server", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # ------------------------------------------------------------------ the step's ops

    def expose(self, key: str, block_ids: list[int]) -> None:
        with self._lock:
            self._exposed[key] = frozenset(block_ids)

    def unexpose(self, key: str) -> None:
        with self._lock:
            self._exposed.pop(key, None)
            self._gone[key] = None
            while len(self._gone) > GONE_MEMORY:
                self._gone.popitem(last=False)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        sock = self.sock
        while not self._stop.is_set():
            progress = self.progress
            hot = progress is not None and time.monotonic() < self._hot_until
            if progress is not None and hot:
                progress()
            if not sock.poll(HOT_POLL_MS if hot else POLL_MS):
                continue
            self._hot_until = time.monotonic() + HOT_S
            frames = sock.recv_multipart()
            if len(frames) != 2:
                continue
            ident, frame = frames
            try:
                msg = self._decoder.decode(frame)
            except ProtocolError as e:
                logger.warning("block server: dropped a bad frame: %s", e)
                continue
            try:
                if isinstance(msg, PeerHello):
                    sock.send_multipart([ident, self._encoder.encode(self.info)])
                elif isinstance(msg, PeerRead):
                    self._read(ident, msg)
            except Exception as e:  # one bad request must not stop the server
                logger.exception("block server: request failed")
                if isinstance(msg, PeerRead):
                    self._reply(ident, PeerReply(seq=msg.seq, status=PEER_ERROR,
                                                 error=f"{type(e).__name__}: {e}"))

    def _status(self, key: str, block_ids: list[int]) -> tuple[int, str]:
        with self._lock:
            held = self._exposed.get(key)
            if held is None:
                # the key is not echoed back: it is a capability, and logs travel
                return (PEER_GONE, "the lease ended") if key in self._gone else (
                    PEER_NOT_YET, "")
        if not held.issuperset(block_ids):
            return PEER_REFUSED, "blocks outside the lease"
        return PEER_OK, ""

    def _read(self, ident: bytes, msg: PeerRead) -> None:
        ids = unpack(msg.block_ids)
        status, error = self._status(msg.key, ids)
        if status != PEER_OK or msg.mode == PEER_CHECK:
            self._reply(ident, PeerReply(seq=msg.seq, status=status, error=error))
            return
        h0, h1 = msg.head_start, msg.head_end
        if not 0 <= h0 < h1 <= self.info.kv_heads:
            self._reply(ident, PeerReply(seq=msg.seq, status=PEER_ERROR,
                                         error=f"heads [{h0}, {h1}) outside [0, "
                                               f"{self.info.kv_heads})"))
            return
        parts = gather(self.caches, ids, h0, h1, self.stream)
        # the lease may have ended while the blocks were gathered: then they are worthless
        status, error = self._status(msg.key, ids)
        if status != PEER_OK:
            self._reply(ident, PeerReply(seq=msg.seq, status=status, error=error))
            return
        bufs = [p.numpy().data.cast("B") for p in parts]
        # zero-copy: ZeroMQ reads the leased blocks themselves (held until the decode engine
        # is done) or the gathered copies, which the frames keep alive
        self.sock.send_multipart([ident, self._encoder.encode(
            PeerReply(seq=msg.seq, status=PEER_OK, nbytes=sum(len(b) for b in bufs))), *bufs],
            copy=False)

    def _reply(self, ident: bytes, reply: PeerReply) -> None:
        self.sock.send_multipart([ident, self._encoder.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2.0)
        self.sock.close(0)


def gather(caches: Sequence[torch.Tensor], block_ids: list[int], h0: int, h1: int,
           stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
    """Heads [h0, h1) of these blocks of each cache, as contiguous host tensors
    ``[n, block_size, h1 - h0, head_dim]``: views of the caches themselves when the blocks are
    consecutive and every head goes (on CPU), else one gather per cache."""
    c0 = caches[0]
    n = len(block_ids)
    whole = h0 == 0 and h1 == c0.shape[2]
    if stream is None and whole and block_ids == list(range(block_ids[0], block_ids[0] + n)):
        return [c[block_ids[0]:block_ids[0] + n] for c in caches]
    shape = (len(caches), n, c0.shape[1], h1 - h0, c0.shape[3])
    if stream is None:
        ids = torch.tensor(block_ids, dtype=torch.long)
        out = torch.empty(shape, dtype=c0.dtype)
        for i, c in enumerate(caches):
            torch.index_select(c[:, :, h0:h1], 0, ids, out=out[i])
        return list(out)
    with torch.cuda.stream(stream):
        ids = torch.tensor(block_ids, dtype=torch.long, device=c0.device)
        dev = torch.empty(shape, dtype=c0.dtype, device=c0.device)
        for i, c in enumerate(caches):
            torch.index_select(c[:, :, h0:h1], 0, ids, out=dev[i])
        out = dev.cpu()  # synchronizes this stream
    return list(out)
