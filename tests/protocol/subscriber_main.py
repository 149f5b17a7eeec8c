"""A stand-in worker for the broadcast tests: run as a separate process.

usage: python subscriber_main.py BROADCAST_ADDR RESULTS_ADDR RANK [SECRET]

Joins with answer_sync, then hashes every SchedulerOutput frame it receives, checking that
step ids have no gap; on Shutdown it reports (count, checksum) as a ModelRunnerOutput. Every
wait has a timeout so an orphaned subscriber exits by itself.
"""

from __future__ import annotations

import hashlib
import sys

import zmq

from protocol.codec import Encoder, ProtocolError, broadcast_decoder
from protocol.messages import HealthPing, ModelRunnerOutput, SchedulerOutput, Shutdown, WorkerError
from protocol.transport import answer_sync, make_socket, recv_frame

TIMEOUT_MS = 30_000


def main(argv: list[str]) -> int:
    bc_addr, res_addr, rank = argv[0], argv[1], int(argv[2])
    secret = argv[3].encode() if len(argv) > 3 else None
    ctx = zmq.Context()
    sub = make_socket(ctx, zmq.SUB, bc_addr, bind=False, secret=secret)
    push = make_socket(ctx, zmq.PUSH, res_addr, bind=False, secret=secret, linger_ms=5000)
    enc, dec = Encoder(), broadcast_decoder()
    try:
        sync_nonce = answer_sync(sub, push, rank, TIMEOUT_MS / 1000, encoder=enc)
        digest = hashlib.sha256()
        count = 0
        while True:
            frame = recv_frame(sub, TIMEOUT_MS)
            if frame is None:
                return 2
            try:
                msg = dec.decode(frame)
            except ProtocolError as e:
                push.send(enc.encode(WorkerError(rank=rank, message=str(e))))
                return 1
            if isinstance(msg, HealthPing) and msg.nonce == sync_nonce:
                continue  # late copies of the start-up ping
            if isinstance(msg, SchedulerOutput):
                if msg.step_id != count:
                    err = f"step gap: expected {count}, got {msg.step_id}"
                    push.send(enc.encode(WorkerError(rank=rank, message=err, step_id=msg.step_id)))
                    return 1
                digest.update(frame)
                count += 1
            elif isinstance(msg, Shutdown):
                checksum = int.from_bytes(digest.digest()[:7], "little")
                out = ModelRunnerOutput(
                    step_id=count, rank=rank, req_handles=b"", checksum=checksum
                )
                push.send(enc.encode(out))
                return 0
    finally:
        sub.close()
        push.close()  # linger lets the last report leave before the process exits
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
