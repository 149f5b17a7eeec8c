"""Fuzz every wire decoder with mutated valid frames and random bytes.

Each input must decode to a message of that decoder's union or raise ProtocolError; anything else
(another exception, a crash, a hang) is a failure. Mutations: bit flips, byte overwrites,
truncation, extension, splices of two frames, header swaps, pure random bytes.

    python scripts/fuzz_decoders.py --n 100000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402

from protocol.codec import (  # noqa: E402
    HEADER,
    Encoder,
    ProtocolError,
    broadcast_decoder,
    engine_decoder,
    frontend_decoder,
    pack,
    worker_decoder,
)
from protocol.messages import (  # noqa: E402
    AbortRequests,
    AddRequest,
    EngineCoreOutput,
    EngineDead,
    EngineOutputs,
    HealthPing,
    HealthPong,
    HealthRequest,
    SamplingParams,
    Shutdown,
    ShutdownEngine,
    WorkerError,
)
from protocol.request_options import RequestOptions


def seed_frames() -> list[bytes]:
    enc = Encoder()
    msgs: list[msgspec.Struct] = [
        AddRequest(
            request_id="r1",
            prompt_token_ids=pack([1, 2, 3, 70000]),
            sampling_params=SamplingParams(max_tokens=5, temperature=0.7, top_k=4, seed=3),
            arrival_time=1.5,
            options=RequestOptions(cache_salt="s"),
        ),
        AbortRequests(["a", "b"]),
        HealthRequest(7),
        ShutdownEngine(),
        EngineOutputs(
            [EngineCoreOutput(request_id="x", new_token_ids=[1, 2], finish_reason="length")], 2.0
        ),
        EngineDead("boom"),
        HealthPing(3),
        Shutdown("bye"),
        HealthPong(rank=1, nonce=2, last_step_id=9),
        WorkerError(rank=0, message="m", traceback="t", step_id=1),
    ]
    out = []
    for m in msgs:
        try:
            out.append(enc.encode(m))
        except TypeError:
            continue
    out.append(HEADER + msgspec.msgpack.encode([1, "r", b"\x00" * 8, [], 0, None, 0.0]))
    return out


def mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    f = bytearray(rng.choice(seeds))
    op = rng.randrange(8)
    if op == 0 and f:  # bit flips
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(f))
            f[i] ^= 1 << rng.randrange(8)
    elif op == 1 and f:  # byte overwrites with interesting values
        for _ in range(rng.randrange(1, 4)):
            f[rng.randrange(len(f))] = rng.choice([0, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDD, 0xFF])
    elif op == 2:  # truncation
        f = f[: rng.randrange(len(f) + 1)]
    elif op == 3:  # extension with random bytes
        f += os.urandom(rng.randrange(1, 64))
    elif op == 4:  # splice two frames
        g = rng.choice(seeds)
        f = f[: rng.randrange(len(f) + 1)] + g[rng.randrange(len(g) + 1) :]
    elif op == 5:  # random header
        f[:2] = bytes([rng.randrange(256), rng.randrange(256)])
    elif op == 6:  # pure random
        f = bytearray(os.urandom(rng.randrange(0, 128)))
    else:  # valid header + random msgpack-ish body
        f = bytearray(HEADER + os.urandom(rng.randrange(0, 64)))
    return bytes(f)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    decoders = [
        frontend_decoder(1 << 16),
        engine_decoder(1 << 16),
        broadcast_decoder(1 << 16),
        worker_decoder(1 << 16),
    ]
    seeds = seed_frames()
    decoded = rejected = 0
    failures: list[str] = []
    t0 = time.monotonic()
    for i in range(args.n):
        frame = mutate(rng, seeds)
        for dec in decoders:
            try:
                dec.decode(frame)
                decoded += 1
            except ProtocolError:
                rejected += 1
            except Exception:  # any other exception is a decoder bug
                if len(failures) < 20:
                    failures.append(f"input {i} {frame!r}: {traceback.format_exc(limit=2)}")
    result = {
        "inputs": args.n,
        "decode_calls": args.n * len(decoders),
        "decoded": decoded,
        "rejected_with_protocol_error": rejected,
        "failures": len(failures),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    for f in failures:
        print(f, file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
