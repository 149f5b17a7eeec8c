"""The client side of an online serving load, shared by bench_serve.py (the Python API) and
bench_serve_http.py (any OpenAI-compatible server): timed arrivals, one record per request, and
the latency summary."""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench_common import distribution


@dataclass
class Record:
    """One request as the client saw it (perf_counter seconds)."""

    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    done: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.num_tokens < 2:
            return None
        return (self.done - self.token_times[0]) / (self.num_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives (gamma inter-arrival times)."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)  # mean inter-arrival = shape * theta = 1 / rate
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


def run_one(llm: Any, prompt: Any, params: Any, timeout_s: float) -> Record:
    rec = Record(sent=time.perf_counter())
    try:
        for ev in llm.generate_stream([prompt], params, timeout_s=timeout_s):
            now = time.perf_counter()
            if ev.new_token_ids:
                rec.token_times.append(now)
                rec.num_tokens += len(ev.new_token_ids)
            if ev.finish_reason is not None:
                rec.error = ev.error if ev.finish_reason == "error" else None
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        rec.error = f"{type(e).__name__}: {e}"
    rec.done = time.perf_counter()
    return rec


def run_load(llm: Any, prompts: list[Any], params: Any, args: argparse.Namespace):
    """Start every request at its arrival time; returns (records, wall seconds)."""
    offsets = arrival_offsets(len(prompts), args.request_rate, args.burstiness, args.seed)
    limit = args.max_concurrency or len(prompts)
    gate = threading.BoundedSemaphore(limit)

    def job(prompt: Any) -> Record:
        try:
            return run_one(llm, prompt, params, args.timeout_s)
        finally:
            gate.release()

    futures = []
    with ThreadPoolExecutor(max_workers=max(1, min(limit, len(prompts)))) as pool:
        start = time.perf_counter()
        for prompt, off in zip(prompts, offsets, strict=True):
            delay = start + off - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            gate.acquire()  # blocks while --max-concurrency requests are in flight
            futures.append(pool.submit(job, prompt))
        records = [f.result(timeout=args.timeout_s + 60) for f in futures]
    return records, time.perf_counter() - start


def summarize(records: list[Record], wall: float, slo: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.token_times]
    out_tok = sum(r.num_tokens for r in ok)
    res: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": wall,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / wall,
        "output_tokens_per_s": out_tok / wall,
    }
    res |= distribution([r.ttft for r in ok], "ttft", "ms", 1e3)
    res |= distribution([t for r in ok if (t := r.tpot) is not None], "tpot", "ms", 1e3)
    res |= distribution([x for r in ok for x in r.itls], "itl", "ms", 1e3)
    res |= distribution([r.done - r.sent for r in ok], "e2el", "ms", 1e3)

    def good(r: Record) -> bool:
        e2el = r.done - r.sent
        vals = {"ttft": r.ttft * 1e3, "tpot": (r.tpot or 0.0) * 1e3, "e2el": e2el * 1e3}
        return all(vals[k] <= v for k, v in slo.items())

    res["goodput_rps"] = sum(good(r) for r in ok) / wall
    res["slo_ms"] = slo
    return res
