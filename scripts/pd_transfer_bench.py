"""KV transfer speed per transport, for bench_pd.py: a prefill rank's block server in a child
process (its caches in a memfd, registered with NIXL when NIXL imports) and a decode rank's
puller here, moving the same blocks with each transport; against two baselines measured in the
same run: a memcpy of the same bytes in one process (what shared memory and NIXL's same-host
path run over) and a raw TCP socket between the two processes (what the TCP pull runs over).
Each figure is the best of its repeats: the machine is shared, and noise only adds time.

    python scripts/pd_transfer_bench.py --serve NUM_BLOCKS BLOCK_SIZE HEADS HEAD_DIM CACHES
(the child; it prints its ports as one JSON line and serves until stdin closes)
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol.codec import Decoder, pack, unpack  # noqa: E402
from protocol.kv_connector import KVConnectorReport, KVLoadOp  # noqa: E402
from protocol.kv_peer import PeerInfo  # noqa: E402
from workers.kv_connector.block_server import BlockServer  # noqa: E402
from workers.kv_connector.nixl import NixlAgent, nixl_available  # noqa: E402
from workers.kv_connector.puller import LocalLayout, Puller, boot_id  # noqa: E402
from workers.kv_connector.shm import SharedCaches  # noqa: E402

KEY = "bench#1"


def serve(num_blocks: int, bs: int, heads: int, hd: int, ncaches: int) -> None:
    torch.set_num_threads(1)  # as a rank of a two-rank engine on this machine
    torch.manual_seed(0)
    caches = [torch.randn(num_blocks, bs, heads, hd) for _ in range(ncaches)]
    shared = SharedCaches(caches)
    caches = shared.tensors
    agent = NixlAgent(f"bench-p-{os.getpid()}", caches) if nixl_available() else None
    info = PeerInfo(engine_id="bench", rank=0, tp_size=1, hostname=socket.gethostname(),
                    boot_id=boot_id(), pid=os.getpid(), device="cpu", dtype="float32",
                    num_caches=ncaches, num_blocks=num_blocks, block_size=bs, kv_heads=heads,
                    total_kv_heads=heads, head_dim=hd, shm_fd=shared.fd,
                    nixl_metadata=agent.metadata if agent else b"",
                    cache_addrs=[c.data_ptr() for c in caches] if agent else [])
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    server = BlockServer(ctx, "tcp://127.0.0.1:*", None, caches, info,
                         agent.progress if agent else None)
    server.expose(KEY, list(range(1, num_blocks)))
    server.start()
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen(1)
    blob = memoryview(bytearray(os.urandom(1 << 20)) * 64)  # 64 MiB to send from
    threading.Thread(target=_raw_server, args=(raw, blob), daemon=True).start()
    print(json.dumps({"port": server.port, "raw_port": raw.getsockname()[1]}), flush=True)
    sys.stdin.read()  # until the parent is done
    server.close()


def _raw_server(raw: socket.socket, blob: memoryview) -> None:
    while True:
        conn, _ = raw.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                head = conn.recv(8)
                if len(head) < 8:
                    break
                left = int.from_bytes(head, "little")
                while left:
                    n = min(left, len(blob))
                    conn.sendall(blob[:n])
                    left -= n


def raw_socket_gbps(port: int, nbytes: int, repeats: int) -> float:
    buf = memoryview(bytearray(nbytes))
    times = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            s.sendall(nbytes.to_bytes(8, "little"))
            got = 0
            while got < nbytes:
                got += s.recv_into(buf[got:], nbytes - got)
            times.append(time.perf_counter() - t0)
    return nbytes / min(times[1:]) / 1e9


def memcpy_gbps(num_blocks: int, bs: int, heads: int, hd: int, ncaches: int, n: int,
                repeats: int) -> float:
    """The same blocks copied the same way (one copy per cache of the consecutive run) between
    two tensors of this process: the ceiling of a one-copy transport."""
    src = [torch.randn(num_blocks, bs, heads, hd) for _ in range(ncaches)]
    dst = [torch.zeros_like(c) for c in src]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for d, c in zip(dst, src, strict=True):
            d[1:n + 1].copy_(c[1:n + 1])
        times.append(time.perf_counter() - t0)
    return n * ncaches * bs * heads * hd * 4 / min(times[1:]) / 1e9


def transport_gbps(transport: str, port: int, num_blocks: int, bs: int, heads: int, hd: int,
                   ncaches: int, n: int, repeats: int, scattered: bool = False
                   ) -> dict[str, float]:
    """``scattered``: the destination blocks in reverse order, so no two are consecutive in
    both pools (every copy by index, one NIXL descriptor per block)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    results = ctx.socket(zmq.PULL)
    rport = results.bind_to_random_port("tcp://127.0.0.1")
    caches = [torch.zeros(num_blocks, bs, heads, hd) for _ in range(ncaches)]
    lay = LocalLayout(0, ncaches, bs, heads, heads, hd, "float32")
    puller = Puller(ctx, transport, None, lay, caches)
    puller.start(f"tcp://127.0.0.1:{rport}")
    dec: Decoder[KVConnectorReport] = Decoder(KVConnectorReport)
    blocks = list(range(1, n + 1))
    local = blocks[::-1] if scattered else blocks
    secs, nbytes = [], 0
    try:
        for i in range(repeats + 1):  # the first connects (handshake, NIXL wireup): not timed
            t0 = time.perf_counter()
            puller.submit(KVLoadOp(load_id=i, block_ids=pack(local), remote_block_ids=pack(
                blocks), remote_key=KEY, remote_engine_id="bench", remote_host="127.0.0.1",
                remote_rank_ports=[port]))
            if not results.poll(120_000):
                raise RuntimeError(f"{transport}: no report")
            rep = dec.decode(results.recv())
            if unpack(rep.failed):
                raise RuntimeError(f"{transport}: {rep.reasons}")
            if i:
                secs.append(time.perf_counter() - t0)
                nbytes = rep.nbytes
    finally:
        puller.close()
        results.close(0)
        ctx.term()
    t = min(secs)
    return {"gbps": nbytes / t / 1e9, "seconds": t, "median_seconds": statistics.median(secs),
            "bytes": nbytes}


def run(num_blocks: int = 1025, bs: int = 16, heads: int = 4, hd: int = 64, ncaches: int = 8,
        n: int = 256, repeats: int = 10) -> dict[str, object]:
    """Every transport moving ``n`` blocks (dummy:tiny's layout by default: 128 KiB each),
    with both baselines. One torch thread, as a rank has on this machine (cores / ranks):
    with two, copies here ran at a fifth of the speed on a busy two-core box."""
    torch.set_num_threads(1)
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(num_blocks), str(bs), str(heads), str(hd),
         str(ncaches)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        while not line.startswith("{"):  # a library's log lines may come first
            if not line:
                raise RuntimeError("the block server process exited")
            line = child.stdout.readline()
        ports = json.loads(line)
        per_block = ncaches * bs * heads * hd * 4
        nbytes = n * per_block
        out: dict[str, object] = {
            "kv_bytes_per_transfer": nbytes,
            "memcpy_gbps": memcpy_gbps(num_blocks, bs, heads, hd, ncaches, n, repeats),
            "raw_socket_gbps": raw_socket_gbps(ports["raw_port"], nbytes, repeats),
        }
        baseline = {"tcp": "raw_socket_gbps", "shm": "memcpy_gbps", "nixl": "memcpy_gbps"}
        names = ["tcp", "shm"] + (["nixl"] if nixl_available() else [])
        for name in names:
            r = transport_gbps(name, ports["port"], num_blocks, bs, heads, hd, ncaches, n,
                               repeats)
            base = out[baseline[name]]
            assert isinstance(base, float)
            out[name] = {**r, "baseline": baseline[name], "of_baseline": r["gbps"] / base}
            out[f"{name}_scattered_gbps"] = transport_gbps(
                name, ports["port"], num_blocks, bs, heads, hd, ncaches, n, repeats,
                scattered=True)["gbps"]
        return out
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(30)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(*map(int, sys.argv[2:7]))
    else:
        print(json.dumps(run()))
