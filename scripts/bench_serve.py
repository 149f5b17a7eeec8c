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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    Profiling,
    add_workload_args,
    build_parser,
    emit_json,
    make_prompts,
    print_breakdown,
    sampling_params,
    scheduler_summary,
    start_llm,
)
from serve_load import run_load, run_one, summarize  # noqa: E402


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
        args.dtype = llm.info.dtype or args.dtype  # "auto" as the ranks resolved it
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
