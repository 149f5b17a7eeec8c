"""Latency of one batch: the same batch run repeatedly after warm-up, time per iteration.

    python scripts/bench_latency.py --batch-size 8 --input-len 32 --output-len 128 --json

Last stdout line with --json: {"latency_mean_s", "latency_p50_s", "latency_p90_s",
"latency_p99_s", "latencies_s", ...} and the roofline of one iteration (scripts/roofline.py):
"roofline_floor_s", "roofline_fraction" = floor / latency_p50_s, "peak_tflops",
"peak_bandwidth_gbs", "peak_source".
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    Profiling,
    build_parser,
    emit_json,
    percentile,
    print_breakdown,
    scheduler_summary,
    start_llm,
)
from roofline import add_roofline_args, print_roofline, roofline_report  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.split("\n")[0])
    g = p.add_argument_group("workload")
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--input-len", type=int, default=32)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--num-iters-warmup", type=int, default=2)
    g.add_argument("--num-iters", type=int, default=10)
    g.add_argument("--prompts-file", default=None)  # not used; keeps start_llm's contract
    add_roofline_args(p)
    args = p.parse_args(argv)
    args.prompts_file = None
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from launch import SamplingParams

    llm = start_llm(args)
    prof = Profiling(llm, args)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)
    latencies: list[float] = []
    try:
        vocab = llm.info.vocab_size

        def one_iter() -> float:
            # Fresh random prompts each time: a prefix-cache hit would skip the prefill.
            batch = [
                [rng.randrange(vocab) for _ in range(args.input_len)]
                for _ in range(args.batch_size)
            ]
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            bad = [o for o in outs if o.finish_reason == "error"]
            if bad:
                raise SystemExit(f"request failed: {bad[0].error}")
            return dt

        for _ in range(args.num_iters_warmup):
            one_iter()
        stats_before = llm.get_stats()
        prof.start()
        for _ in range(args.num_iters):
            latencies.append(one_iter())
        breakdown = prof.stop()
        stats_after = llm.get_stats()
        device = llm.info.device
        # "auto" as the ranks resolved it: the report and the roofline's bytes per weight
        args.dtype = llm.info.dtype or args.dtype
    finally:
        llm.shutdown()
        prof.close()
    result: dict[str, Any] = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": len(latencies),
        "latency_mean_s": statistics.fmean(latencies),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p90_s": percentile(latencies, 90),
        "latency_p99_s": percentile(latencies, 99),
        "latencies_s": latencies,
    }
    result.update(breakdown)
    result.update(scheduler_summary(args, stats_before, stats_after))
    # One iteration's floor against the median iteration; peaks measured with the engine gone.
    result.update(roofline_report(
        args, device, [args.input_len] * args.batch_size, [args.output_len] * args.batch_size,
        max_batch=args.max_num_seqs, measured_s=result["latency_p50_s"]))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.json:
        emit_json(res)
        return 0
    print(
        f"batch {res['batch_size']} x ({res['input_len']} in -> {res['output_len']} out), "
        f"{res['num_iters']} iterations: mean {res['latency_mean_s']:.3f} s, "
        f"p50 {res['latency_p50_s']:.3f} s, p90 {res['latency_p90_s']:.3f} s, "
        f"p99 {res['latency_p99_s']:.3f} s"
    )
    print_roofline(res)
    if "non_forward_fraction" in res:
        print_breakdown(
            {k: v for k, v in res.items() if k.endswith("_median_us")}
            | {"steps": res["steps"], "non_forward_fraction": res["non_forward_fraction"]}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
