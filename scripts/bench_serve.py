"""Online serving load through the streaming API: timed arrivals, TTFT / TPOT / ITL / E2E latency.

Each request runs in its own thread (LLM.generate_stream of one prompt), started at its arrival
time: a Poisson process at --request-rate (gamma with shape --burstiness; 1 = Poisson), all at
once when the rate is inf, and at most --max-concurrency in flight when given.

With --base-url the same arrival process drives any OpenAI-compatible server instead (Tandem's
`python -m launch serve`, vLLM, SGLang): streamed /v1/completions with token-id prompts, one
asyncio task per request; --with-python-api then runs the same workload through the Python API
in the same run and reports it under "python_api".

    python scripts/bench_serve.py --num-prompts 200 --request-rate 20 --slo ttft=200,tpot=50 --json
    python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --json

Last stdout line with --json: ttft/tpot/itl/e2el x {mean, median, p90, p95, p99} in ms
(e.g. "ttft_p99_ms"), "request_throughput", "output_tokens_per_s", "goodput_rps", ...
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    Profiling,
    add_workload_args,
    build_parser,
    distribution,
    emit_json,
    make_prompts,
    print_breakdown,
    sampling_params,
    scheduler_summary,
    start_llm,
)


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


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=200,tpot=50' (milliseconds) -> {'ttft': 200.0, 'tpot': 50.0}."""
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        key, _, val = part.partition("=")
        key = key.strip().lower()
        if key not in ("ttft", "tpot", "e2el") or not val:
            raise argparse.ArgumentTypeError(f"bad SLO {part!r}; use ttft=MS,tpot=MS,e2el=MS")
        out[key] = float(val)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.split("\n")[0])
    add_workload_args(p, num_prompts=100, in_len=128, out_len=64)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: burst)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--num-warmup", type=int, default=2, help="untimed requests first")
    g.add_argument("--slo", type=parse_slo, default={}, help="goodput SLOs in ms: ttft=,tpot=")
    g.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    h = p.add_argument_group("HTTP (an OpenAI-compatible server instead of the Python API)")
    h.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000")
    h.add_argument("--served-model-name", default=None,
                   help="`model` sent in requests (default: the first of GET /v1/models)")
    h.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    h.add_argument("--vocab-size", type=int, default=None,
                   help="random prompt token ids are drawn below this (default: the server's "
                   "vocabulary when it is Tandem's --model, else 32000)")
    h.add_argument("--with-python-api", action="store_true",
                   help="also run the same workload through the Python API (engine flags as "
                   "given here) and report it under python_api")
    return p.parse_args(argv)


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


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = start_llm(args)
    prof = Profiling(llm, args)
    try:
        prompts = make_prompts(args, llm.info.vocab_size)
        params = sampling_params(args)
        rng = random.Random(args.seed + 1)
        warm = [[rng.randrange(llm.info.vocab_size) for _ in range(8)] for _ in range(2)]
        for i in range(args.num_warmup):
            run_one(llm, warm[i % 2], params, args.timeout_s)
        stats_before = llm.get_stats()
        prof.start()
        records, wall = run_load(llm, prompts, params, args)
        breakdown = prof.stop()
        stats_after = llm.get_stats()
    finally:
        llm.shutdown()
        prof.close()
    res = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "dtype": args.dtype,
        "num_prompts": len(prompts),
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    res |= summarize(records, wall, args.slo)
    res |= breakdown
    res |= scheduler_summary(args, stats_before, stats_after)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        from bench_serve_http import run_http

        res = run_http(args)
    else:
        res = run(args)
    if args.json:
        emit_json(res)
        return 0 if res["failed"] == 0 else 1
    print(
        f"{res['completed']} ok / {res['failed']} failed in {res['duration_s']:.2f} s: "
        f"{res['request_throughput']:.2f} req/s, {res['output_tokens_per_s']:.0f} output tok/s, "
        f"goodput {res['goodput_rps']:.2f} req/s"
    )
    for m in ("ttft", "tpot", "itl", "e2el"):
        vals = "  ".join(
            f"{s} {res[f'{m}_{s}_ms']:.1f}" for s in ("mean", "median", "p90", "p95", "p99")
        )
        print(f"  {m:<5} ms: {vals}")
    if "python_api" in res:
        py = res["python_api"]
        print(
            f"  Python API, same workload: {py['output_tokens_per_s']:.0f} output tok/s, "
            f"TTFT median {py['ttft_median_ms']:.1f} ms; HTTP/Python throughput "
            f"{res['http_over_python_throughput']:.3f}"
        )
    if "non_forward_fraction" in res:
        keys = {"steps", "non_forward_fraction"}
        print_breakdown({k: v for k, v in res.items() if k.endswith("_median_us") or k in keys})
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
