"""Disaggregated prefill / decode, measured:

1. KV transfer speed per transport (TCP pull, shared memory, NIXL when it imports) against a
   memcpy and a raw TCP socket measured in the same run (pd_transfer_bench.py);
2. TTFT split: a prompt's prefill on P, its KV transfer to D, and D's wait until its first
   token (everything of D's TTFT that was not the transfer);
3. the P/D argument on dummy:tiny: a prefill-heavy load (long prompts arriving while others
   decode), on a P/D pair of 1 + 1 workers against one engine of the same 2 workers (TP 2):
   decode TPOT p99 (and inter-token latency p99), TTFT and throughput of each.

    python scripts/bench_pd.py [--quick] [--json]

With --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import distribution, emit_json, percentile  # noqa: E402
from pd_transfer_bench import run as transfer_bench  # noqa: E402

from launch import LLM, SamplingParams  # noqa: E402
from protocol.kv_connector import KVTransferConfig, KVTransferParams  # noqa: E402

MODEL = "dummy:tiny"
OPTS: dict[str, Any] = dict(load_tokenizer=False, kv_cache_memory=256 << 20, max_model_len=4096,
                            enable_prefix_caching=False)
PREFILL = KVTransferParams(do_remote_decode=True)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 31000) for _ in range(n)]


def ttft_split(p: LLM, d: LLM, prompt_len: int, count: int) -> dict[str, float]:
    """Sequential requests: P's TTFT (prefill), the transfer (D's report), D's TTFT."""
    rng = random.Random(1)
    pre, xfer, dwait, total = [], [], [], []
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for _ in range(count):
        prompt = _prompt(rng, prompt_len)
        t0 = time.time()
        a = p.generate([prompt], one, use_tqdm=False, kv_transfer_params=PREFILL)[0]
        s0 = d.get_stats()
        b = d.generate([prompt], gen, use_tqdm=False, kv_transfer_params=a.kv_transfer_params)[0]
        s1 = d.get_stats()
        assert b.metrics.num_cached_tokens == prompt_len - 1, "the KV did not come over"
        t = s1["kv_transfer_seconds_sum"] - s0["kv_transfer_seconds_sum"]
        pre.append(a.metrics.ttft or 0.0)
        xfer.append(t)
        dwait.append((b.metrics.ttft or 0.0) - t)
        total.append((b.metrics.first_token_time or t0) - t0)
    med = lambda xs: percentile(xs, 50) * 1e3  # noqa: E731
    return {"prompt_len": prompt_len, "prefill_ms": med(pre), "transfer_ms": med(xfer),
            "decode_wait_ms": med(dwait), "ttft_ms": med(total)}


def _workload(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival offset s, prompt, max tokens): long prompts arriving while others decode."""
    rng = random.Random(0)
    out, t = [], 0.0
    for _ in range(args.num_requests):
        out.append((t, _prompt(rng, args.prompt_len), args.output_len))
        t += rng.expovariate(args.rate)
    return out


def _run_load(work: list[tuple[float, list[int], int]], serve_one) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Every request on its own thread at its arrival time; TPOT and ITL of the decode."""
    results: list[Any] = [None] * len(work)
    start = time.time() + 0.2

    def one(i: int) -> None:
        at, prompt, n = work[i]
        time.sleep(max(0.0, start + at - time.time()))
        results[i] = serve_one(prompt, n)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(work))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    end = max(r.metrics.finished_time for r in results)
    tpots = [r.metrics.tpot for r in results if r.metrics.tpot is not None]
    itls = [b - a for r in results
            for a, b in zip(r.metrics.token_times, r.metrics.token_times[1:], strict=False)]
    ttfts = [r.metrics.first_token_time - (start + w[0]) for r, w in zip(results, work,
                                                                            strict=True)]
    out_tokens = sum(len(r.token_ids) for r in results)
    return {
        **distribution(tpots, "tpot", "ms", 1e3),
        "itl_p99_ms": percentile(itls, 99) * 1e3,
        **distribution(ttfts, "ttft", "ms", 1e3),
        "throughput_tok_s": out_tokens / (end - start),
        "errors": sum(r.finish_reason == "error" for r in results),
    }


def pd_vs_single(args: argparse.Namespace) -> dict[str, Any]:
    work = _workload(args)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    kv = KVTransferConfig(kv_connector=args.kv_connector)
    with LLM(MODEL, 1, kv_transfer_config=kv, **OPTS) as p, \
            LLM(MODEL, 1, kv_transfer_config=kv, **OPTS) as d:

        def disagg(prompt: list[int], n: int) -> Any:
            a = p.generate([prompt], greedy(1), use_tqdm=False, kv_transfer_params=PREFILL)[0]
            b = d.generate([prompt], greedy(n), use_tqdm=False,
                           kv_transfer_params=a.kv_transfer_params)[0]
            b.metrics.arrival_time = a.metrics.arrival_time  # TTFT from the P request on
            return b

        split = ttft_split(p, d, args.prompt_len, 3 if args.quick else 8)
        pd = _run_load(work, disagg)
        pd["transfers"] = d.get_stats()["kv_transfers"]
    with LLM(MODEL, 2, **OPTS) as single:
        mono = _run_load(work, lambda prompt, n: single.generate(
            [prompt], greedy(n), use_tqdm=False)[0])
    return {"ttft_split": split, "pd_1p1d": pd, "single_tp2": mono,
            "tpot_p99_ratio_pd_over_single": pd["tpot_p99_ms"] / mono["tpot_p99_ms"],
            "throughput_ratio_pd_over_single":
                pd["throughput_tok_s"] / mono["throughput_tok_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a smoke-test size")
    ap.add_argument("--transfers-only", action="store_true", help="only part 1")
    ap.add_argument("--kv-connector", default="auto", choices=["auto", "tcp", "shm", "nixl"])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=1536)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="arrivals per second (Poisson)")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 4, 256, 8
    result: dict[str, Any] = {"transfers": transfer_bench(n=32 if args.quick else 256,
                                                          repeats=3 if args.quick else 10)}
    t = result["transfers"]
    for name in ("tcp", "shm", "nixl"):
        if name in t:
            print(f"{name:<5} {t[name]['gbps']:6.2f} GB/s = {t[name]['of_baseline']:.0%} of "
                  f"{t[name]['baseline']} ({t[t[name]['baseline']]:.2f} GB/s); blocks "
                  f"scattered: {t[name + '_scattered_gbps']:.2f} GB/s")
    if not args.transfers_only:
        result |= pd_vs_single(args)
        s = result["ttft_split"]
        print(f"TTFT {s['ttft_ms']:.1f} ms = prefill {s['prefill_ms']:.1f} + transfer "
              f"{s['transfer_ms']:.2f} + decode wait {s['decode_wait_ms']:.1f} (+ hand-over)")
        for k in ("pd_1p1d", "single_tp2"):
            r = result[k]
            print(f"{k:<11} TPOT p99 {r['tpot_p99_ms']:7.1f} ms  ITL p99 {r['itl_p99_ms']:7.1f} ms"
                  f"  TTFT p50 {r['ttft_median_ms']:7.1f} ms  {r['throughput_tok_s']:7.1f} tok/s")
    result["config"] = {k: getattr(args, k) for k in ("kv_connector", "num_requests",
                                                      "prompt_len", "output_len", "rate")}
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
