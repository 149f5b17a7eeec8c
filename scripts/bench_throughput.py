"""Offline throughput: N prompts (random token ids or a file) -> output_len tokens each, ignore_eos.

    python scripts/bench_throughput.py -tp 2 --num-prompts 64 --input-len 128 --output-len 64 --json
    python scripts/bench_throughput.py --num-prompts 256 --input-len 32 --breakdown -tp 2

Last stdout line with --json: {"requests_per_s", "input_tokens_per_s", "output_tokens_per_s",
"total_s", ...} (+ "non_forward_fraction" and per-phase medians with --breakdown), and the
roofline (scripts/roofline.py): "roofline_floor_s" for this workload at the device's peaks,
"roofline_fraction" = floor / total_s, "peak_tflops", "peak_bandwidth_gbs", "peak_source".
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    Profiling,
    add_workload_args,
    build_parser,
    emit_json,
    make_prompts,
    percentile,
    print_breakdown,
    sampling_params,
    scheduler_summary,
    start_llm,
)
from roofline import add_roofline_args, print_roofline, roofline_report  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser(__doc__.split("\n")[0])
    add_workload_args(p, num_prompts=64, in_len=128, out_len=64)
    p.add_argument(
        "--warmup-prompts",
        type=int,
        default=8,
        help="a short untimed batch first (other random prompts: no prefix-cache hits)",
    )
    add_roofline_args(p)
    return p.parse_args(argv)


def warm_up(llm: Any, args: argparse.Namespace, vocab: int) -> None:
    if args.warmup_prompts <= 0:
        return
    from launch import SamplingParams

    rng = random.Random(args.seed + 1)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(8)]
    prompts = prompts[: args.warmup_prompts]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = start_llm(args)
    prof = Profiling(llm, args)
    try:
        prompts = make_prompts(args, llm.info.vocab_size)
        params = sampling_params(args)
        warm_up(llm, args, llm.info.vocab_size)
        stats_before = llm.get_stats()
        prof.start()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=not args.json)
        total = time.perf_counter() - t0
        breakdown = prof.stop()
        stats_after = llm.get_stats()
        device = llm.info.device
        # "auto" as the ranks resolved it: the report and the roofline's bytes per weight
        args.dtype = llm.info.dtype or args.dtype
    finally:
        llm.shutdown()
        prof.close()
    errors = [o for o in outs if o.finish_reason == "error"]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0].error}")
    in_tok = sum(len(o.prompt_token_ids) for o in outs)
    out_tok = sum(len(o.token_ids) for o in outs)
    tpots = [o.metrics.tpot for o in outs if o.metrics.tpot is not None]
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    result: dict[str, Any] = {
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "dtype": args.dtype,
        "num_prompts": len(outs),
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "total_s": total,
        "requests_per_s": len(outs) / total,
        "input_tokens_per_s": in_tok / total,
        "output_tokens_per_s": out_tok / total,
        "tokens_per_s": (in_tok + out_tok) / total,
        "ttft_median_ms": percentile(ttfts, 50) * 1e3,
        "tpot_median_ms": percentile(tpots, 50) * 1e3,
    }
    result.update(breakdown)
    result.update(scheduler_summary(args, stats_before, stats_after))
    # Peaks are measured with the engine gone, so nothing competes for the device.
    result.update(roofline_report(
        args, device, [len(o.prompt_token_ids) for o in outs], [len(o.token_ids) for o in outs],
        max_batch=args.max_num_seqs, measured_s=total))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    if not args.json:
        print(
            f"{res['num_prompts']} requests in {res['total_s']:.2f} s: "
            f"{res['requests_per_s']:.2f} req/s, {res['input_tokens_per_s']:.0f} input tok/s, "
            f"{res['output_tokens_per_s']:.0f} output tok/s "
            f"(TP={res['tensor_parallel_size']}, {res['dtype']})"
        )
        if "spec_acceptance_rate" in res:
            print(
                f"speculation: acceptance rate {res['spec_acceptance_rate']:.3f}, "
                f"mean accepted length {res['spec_mean_accepted_len']:.2f}"
            )
        print_roofline(res)
        print_breakdown({k: v for k, v in res.items() if k in _breakdown_keys(res)})
    else:
        emit_json(res)
    return 0


def _breakdown_keys(res: dict[str, Any]) -> set[str]:
    if "non_forward_fraction" not in res:
        return set()
    return {k for k in res if k.endswith("_median_us") or k in ("steps", "non_forward_fraction")}


if __name__ == "__main__":
    sys.exit(main())
