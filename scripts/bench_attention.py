"""One layer's attention (rotary + KV write + paged attention) per backend, at one step shape.

Times what a single layer's attention costs inside a step, for a decode batch (N requests with C
tokens of context each, 1 + K new tokens) or a prefill batch (N fresh prompts of L tokens), for
each attention backend that runs on the device, and reports the KV bytes each call must read
against the device's memory bandwidth: the figure that says how far a decode kernel is from
its floor. The backends are the ones a worker chooses from (--attention-backend).

    python scripts/bench_attention.py --device cuda --dtype bfloat16 --num-reqs 256 \\
        --context 600 --heads 32 --kv-heads 8 --head-dim 64 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.paged import Seq, build_step  # noqa: E402
from workers import cpu_ops, triton_ops  # noqa: E402
from workers.attention import select_attention_backend  # noqa: E402
from workers.model.layers import RotaryEmbedding  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--num-reqs", type=int, default=64)
    p.add_argument("--context", type=int, default=600, help="cached tokens per request")
    p.add_argument("--new-tokens", type=int, default=1,
                   help="new tokens per request (1 = decode, 1 + K = drafts, > 16 = prefill)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backends", default="auto",
                   help="comma-separated: torch,cpu,triton (auto: those that run here)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                   help="for the bandwidth fraction (default: measured with a device copy)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    bs, n, q_new = args.block_size, args.num_reqs, args.new_tokens
    total = args.context + q_new
    blocks_per = -(-total // bs)
    seqs = [Seq([0] * total, list(range(1 + i * blocks_per, 1 + (i + 1) * blocks_per)),
                args.context) for i in range(n)]
    _, positions, meta = build_step(seqs, [q_new] * n, bs, device)
    num_blocks = 1 + n * blocks_per
    shape = (num_blocks, bs, args.kv_heads, args.head_dim)
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    width = (args.heads + 2 * args.kv_heads) * args.head_dim
    qkv = torch.randn(n * q_new, width, device=device).to(dtype)
    rope = RotaryEmbedding(args.head_dim, total + 1, 10000.0, None, device)

    if args.backends == "auto":
        names = ["torch"]
        if device.type == "cpu" and cpu_ops.ops() is not None:
            names.append("cpu")
        if device.type == "cuda" and triton_ops.available():
            names.append("triton")
    else:
        names = args.backends.split(",")

    kv_bytes = 2 * n * total * args.kv_heads * args.head_dim * dtype.itemsize
    if args.peak_bandwidth_gbs:
        bw, bw_source = args.peak_bandwidth_gbs * 1e9, "flag"
    else:
        src = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        _sync(device)
        bw, bw_source = 2 * 5 * src.numel() / (time.perf_counter() - t0), "measured"

    result: dict = {"device": str(device), "dtype": args.dtype, "num_reqs": n,
                    "context": args.context, "new_tokens": q_new, "heads": args.heads,
                    "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                    "kv_bytes_per_call": kv_bytes, "bandwidth_gbs": round(bw / 1e9, 1),
                    "bandwidth_source": bw_source}
    for name in names:
        backend = select_attention_backend(name, device, args.head_dim)
        step = backend.begin(meta, bs, device)
        times = []
        for i in range(args.iters + 3):
            x = qkv.clone()
            _sync(device)
            t0 = time.perf_counter()
            step(x, positions, rope, args.heads, args.kv_heads, args.head_dim, k_cache, v_cache,
                 args.head_dim**-0.5)
            _sync(device)
            if i >= 3:  # warm-up: kernel compilation, allocator
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        result[f"{name}_us"] = round(med * 1e6, 1)
        result[f"{name}_bandwidth_fraction"] = round(kv_bytes / med / bw, 4)
        if not args.json:
            print(f"{name:>7}: {med * 1e6:9.1f} us per layer call, "
                  f"{kv_bytes / med / 1e9:7.1f} GB/s of KV ({kv_bytes / med / bw:.1%} of peak)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
