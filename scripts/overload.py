"""Overload: drive a server at a multiple of its saturation rate, then let it idle, and check
that it refused what it could not queue, served what it admitted, and kept nothing.

Starts `python -m launch serve` (dummy:micro, TP=1, --max-queued-requests 32 by default),
measures its saturation rate with a closed loop of --max-num-seqs clients (--ramp-s seconds),
then sends Poisson arrivals at --multiplier (4) times that rate for --duration (60) seconds: a
mix of normal requests (half of them streamed), constrained ones (response_format json_schema,
three small schemas) and streams whose client disconnects after its first tokens. Then it
idles (--idle seconds) and reads the census (GET /census) until every per-request map is
empty again.

Reports served / refused (503) / failed / aborted (by the client, on purpose) counts, the p99
latency of the served requests (and of the refusals), the RSS of every process at the start,
its peak and after the idle period, the engine's free KV blocks idle before and after, the
census after, and maps_back_to_idle: every per-request map of every process back to its idle
size and every KV block free again. `--json` prints the figures as the last stdout line.

    python scripts/overload.py --json
    python scripts/overload.py --duration 5 --ramp-s 2 --idle 1 --json   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import emit_json, percentile  # noqa: E402
from openai_http import Target, get_json, request  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
]
WORDS = "the quick brown fox jumps over the lazy dog and then it runs home again".split()


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class Load:
    """The client side: one request of a kind, recorded as (kind, outcome, latency)."""

    def __init__(self, target: Target, args: argparse.Namespace, rng: random.Random) -> None:
        self.target = target
        self.args = args
        self.rng = rng
        self.records: list[tuple[str, str, float]] = []

    def body(self, kind: str) -> dict[str, Any]:
        rng = self.rng
        if kind == "constrained":
            schema = rng.choice(SCHEMAS)
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 16)))
            return {"prompt": prompt, "max_tokens": self.args.output_len,
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "o", "schema": schema}}}
        prompt = [rng.randrange(5, self.args.vocab) for _ in range(rng.randrange(16, 64))]
        return {"prompt": prompt, "max_tokens": self.args.output_len, "ignore_eos": True,
                "temperature": rng.choice([0.0, 0.8]), "stream": kind == "aborted"
                or rng.random() < 0.5}

    async def one(self, kind: str) -> None:
        body = self.body(kind)
        t0 = time.perf_counter()
        events = 0
        enough = asyncio.Event()
        leave_after = self.rng.randrange(1, 4)

        ended = errored = False

        def on_event(data: bytes) -> None:
            nonlocal events, ended, errored
            events += 1
            ended = ended or data == b"[DONE]"
            errored = errored or data.startswith(b'{"error"')
            if kind == "aborted" and events >= leave_after:
                enough.set()

        stream = bool(body.get("stream"))
        task = asyncio.ensure_future(request(self.target, "POST", "/v1/completions", body,
                                             on_event=on_event if stream else None))
        try:
            if kind == "aborted":
                waiter = asyncio.ensure_future(enough.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if not task.done():  # the client leaves mid-stream: its connection closes
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    self.records.append((kind, "aborted", time.perf_counter() - t0))
                    return
            status, raw = await task
        except Exception as e:  # noqa: BLE001 - a broken connection is a result, not a crash
            self.records.append((kind, f"failed: {type(e).__name__}", time.perf_counter() - t0))
            return
        took = time.perf_counter() - t0
        if status == 503:
            outcome = "refused"
        elif status == 200 and (not stream or (ended and not errored)):
            outcome = "served"
        else:
            outcome = f"failed: HTTP {status}"
        self.records.append((kind, outcome, took))


async def saturation(load: Load, clients: int, seconds: float) -> float:
    """Completed requests per second with `clients` always busy (normal requests only)."""
    done = 0
    stop = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            body = load.body("normal") | {"stream": False}
            status, _ = await request(load.target, "POST", "/v1/completions", body)
            done += status == 200
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return done / (time.perf_counter() - t0)


async def census(target: Target) -> dict[str, Any]:
    body: dict[str, Any] = await get_json(target, "/census")
    return body


async def settle(target: Target, timeout_s: float) -> dict[str, Any]:
    """The census once no per-request map holds anything (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = await census(target)
        full = c["num_free_blocks"] == c["num_blocks"] - 1
        if (not c["leftovers"] and full) or time.monotonic() > deadline:
            return c
        await asyncio.sleep(0.2)


def per_request(c: dict[str, Any]) -> dict[str, dict[str, int]]:
    from launch.census import per_request as keep

    return keep(c["census"])


async def run(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    target = Target.parse(base_url)
    rng = random.Random(args.seed)
    load = Load(target, args, rng)
    await asyncio.gather(*(load.one(k) for k in ("normal", "constrained", "aborted") * 4))
    idle = await settle(target, 30)
    pids = idle["pids"]
    rss_start = {name: rss_mb(pid) for name, pid in pids.items()}
    sat = await saturation(load, args.max_num_seqs, args.ramp_s)
    load.records.clear()
    rate = args.multiplier * sat
    peak = dict(rss_start)

    async def sample_rss() -> None:
        while True:
            for name, pid in pids.items():
                peak[name] = max(peak[name], rss_mb(pid))
            await asyncio.sleep(0.25)

    sampler = asyncio.ensure_future(sample_rss())
    kinds, weights = ("normal", "constrained", "aborted"), args.mix
    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    next_at = 0.0
    while next_at < args.duration:
        await asyncio.sleep(max(0.0, t0 + next_at - time.perf_counter()))
        kind = rng.choices(kinds, weights)[0]
        tasks.append(asyncio.ensure_future(load.one(kind)))
        next_at += rng.expovariate(rate)
    await asyncio.wait(tasks, timeout=args.drain_s)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    load_s = time.perf_counter() - t0
    await asyncio.sleep(args.idle)
    after = await settle(target, 30)
    sampler.cancel()
    rss_after = {name: rss_mb(pid) for name, pid in pids.items()}
    outcomes = [o for _, o, _ in load.records]
    served = [t for _, o, t in load.records if o == "served"]
    refused = [t for _, o, t in load.records if o == "refused"]
    failures = sorted({o for o in outcomes if o.startswith("failed")})
    back = (not after["leftovers"] and per_request(after) == per_request(idle)
            and after["num_free_blocks"] == idle["num_free_blocks"])
    return {
        "served": len(served),
        "refused": len(refused),
        "failed": sum(o.startswith("failed") for o in outcomes),
        "aborted": outcomes.count("aborted"),
        "failure_kinds": failures,
        "p99_latency_s": round(percentile(served, 99), 4) if served else None,
        "p50_latency_s": round(percentile(served, 50), 4) if served else None,
        # how fast a refusal comes (connection, 503 and close, as the client sees it)
        "refused_p99_latency_s": round(percentile(refused, 99), 4) if refused else None,
        "saturation_req_s": round(sat, 2),
        "offered_req_s": round(rate, 2),
        "sent": len(load.records),
        "load_s": round(load_s, 1),
        "rss_mb": {name: {"start": round(rss_start[name], 1), "peak": round(peak[name], 1),
                          "after": round(rss_after[name], 1)} for name in pids},
        "free_blocks": {"idle_before": idle["num_free_blocks"],
                        "after": after["num_free_blocks"]},
        "maps_after": after["census"],
        "leftovers": after["leftovers"],
        "maps_back_to_idle": back,
        "config": {"model": args.model, "tp": args.tp, "max_num_seqs": args.max_num_seqs,
                   "max_queued_requests": args.max_queued_requests,
                   "duration_s": args.duration, "multiplier": args.multiplier,
                   "mix": args.mix, "cpus": os.cpu_count()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dummy:micro")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: a small BPE one built for dummy:micro)")
    p.add_argument("--vocab", type=int, default=512, help="prompt token ids drawn below this")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-queued-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--multiplier", type=float, default=4.0)
    p.add_argument("--ramp-s", type=float, default=5.0, help="saturation measurement")
    p.add_argument("--idle", type=float, default=10.0, help="seconds of quiet after the load")
    p.add_argument("--drain-s", type=float, default=120.0,
                   help="how long admitted requests may take to finish after the load")
    p.add_argument("--mix", type=float, nargs=3, default=[0.7, 0.15, 0.15],
                   metavar=("NORMAL", "CONSTRAINED", "ABORTED"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from tests.serve.serve_helpers import make_tokenizer_dir, serve

    with tempfile.TemporaryDirectory(prefix="tandem-overload-") as tmp:
        tok = args.tokenizer or make_tokenizer_dir(os.path.join(tmp, "tok"), args.vocab)
        flags = ["--model", args.model, "--nproc-per-node", str(args.tp), "--tokenizer", tok,
                 "--max-num-seqs", str(args.max_num_seqs),
                 "--max-queued-requests", str(args.max_queued_requests)]
        with serve(*flags, log_dir=tmp) as server:
            result = asyncio.run(run(args, server.base_url))
    if args.json:
        emit_json(result)
    else:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["maps_back_to_idle"] and not res["failed"] else 1)
