"""Image workload: TTFT, throughput, the encoder's share of step time and bytes per image.

    python scripts/bench_mm.py --num-prompts 32 --runs 3 --json
    python scripts/bench_mm.py -tp 2 --lm-hidden 1536 --lm-layers 28 --vision-depth 32

Each prompt has 1 to 4 images drawn from a pool smaller than the number of images sent, so
some repeat (across prompts and inside one), and some prompts repeat whole. The model is a
Qwen2-VL of the given shape with random weights (a config.json and load_format dummy). Two
configurations run in turn, each --runs times: "cached" (defaults: prefix caching and an encoder
cache of --encoder-cache-size) and "uncached" (prefix caching off, the encoder cache only as
large as the largest image, so a repeated image is encoded again). Last stdout line with
--json: per configuration the medians over runs of output tok/s, request/s, TTFT p50/p99, the
encoder's share of the ranks' step time, encoder runs and hits, and pixel bytes on the step
socket per encoded image.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import emit_json, percentile  # noqa: E402

IMAGE, START, END = 151655, 151652, 151653


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--text-len", type=int, default=32, help="text tokens around the images")
    p.add_argument("--pool", type=int, default=12, help="distinct images to draw from")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--lm-hidden", type=int, default=512)
    p.add_argument("--lm-layers", type=int, default=4)
    p.add_argument("--vision-embed", type=int, default=256)
    p.add_argument("--vision-depth", type=int, default=4)
    p.add_argument("--encoder-cache-size", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def write_model(path: str, args: argparse.Namespace) -> None:
    """A Qwen2-VL config.json (Hub layout) of the asked shape; weights are drawn at load."""
    heads = max(1, args.lm_hidden // 128)  # head_dim 128: mrope_section [16, 24, 24]
    cfg = {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        "vocab_size": 151936, "hidden_size": args.lm_hidden,
        "intermediate_size": args.lm_hidden * 4, "num_hidden_layers": args.lm_layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True, "torch_dtype": "float32", "eos_token_id": 151645,
        "image_token_id": IMAGE, "vision_start_token_id": START, "vision_end_token_id": END,
        "vision_config": {"depth": args.vision_depth, "embed_dim": args.vision_embed,
                          "hidden_size": args.lm_hidden,
                          "num_heads": max(1, args.vision_embed // 64), "mlp_ratio": 4,
                          "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "in_chans": 3},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def workload(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    """Prompts (vLLM's dict form) and the largest image's embeddings."""
    rng = random.Random(args.seed)
    nrng = np.random.default_rng(args.seed)
    sides = [(rng.choice([112, 168, 224, 280]), rng.choice([112, 168, 224, 280]))
             for _ in range(args.pool)]
    pool = [nrng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sides]
    largest = max(h * w // (28 * 28) for h, w in sides)
    prompts: list[dict[str, Any]] = []
    for i in range(args.num_prompts):
        if i and rng.random() < 0.2:  # a whole prompt again
            prompts.append(prompts[rng.randrange(len(prompts))])
            continue
        picks = [pool[rng.randrange(args.pool)] for _ in range(rng.randint(1, 4))]
        ids = [rng.randrange(1000, 100000) for _ in range(args.text_len // 2)]
        for _ in picks:
            ids += [START, IMAGE, END, rng.randrange(1000, 100000)]
        ids += [rng.randrange(1000, 100000) for _ in range(args.text_len // 2)]
        prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": picks}})
    return prompts, largest


def run_once(path: str, args: argparse.Namespace, prompts: list[dict[str, Any]],
             options: dict[str, Any]) -> dict[str, float]:
    from launch import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with LLM(model=path, load_format="dummy", tensor_parallel_size=args.tensor_parallel_size,
             load_tokenizer=False, max_num_batched_tokens=args.max_num_batched_tokens,
             **options) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        llm.start_profile(torch_profiler=False)
        before = llm.stop_profile().stats
        llm.start_profile(torch_profiler=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, timeout_s=3600)
        wall = time.perf_counter() - t0
        prof = llm.stop_profile()
    stats = {k: v - before.get(k, 0.0) for k, v in prof.stats.items()
             if isinstance(v, int | float)}
    from engine_core.step_timeline import COLUMNS

    rows = prof.step_timeline
    fwd = COLUMNS.index("worker_forward_us")
    step_us = sum(r[fwd] for r in rows) if rows else 0.0
    ttft = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    runs = stats.get("encoder_runs", 0.0)
    return {
        "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
        "requests_per_s": len(outs) / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "encoder_share_of_forward": (stats.get("encoder_seconds", 0.0) * 1e6 / step_us
                                     if step_us else float("nan")),
        "encoder_runs": runs,
        "encoder_cache_hits": stats.get("encoder_cache_hits", 0.0),
        "prefix_cache_hit_rate": (stats.get("prefix_cache_hits", 0.0)
                                  / max(1.0, stats.get("prefix_cache_queries", 0.0))),
        "pixel_bytes_per_encoded_image": stats.get("encoder_input_bytes", 0.0) / max(1.0, runs),
        "images_sent": float(sum(len(p["multi_modal_data"]["image"]) for p in prompts)),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    prompts, largest = workload(args)
    configs = {
        "cached": dict(encoder_cache_size=args.encoder_cache_size),
        "uncached": dict(enable_prefix_caching=False, encoder_cache_size=largest),
    }
    result: dict[str, Any] = {"tp": args.tensor_parallel_size, "prompts": len(prompts),
                              "runs": args.runs}
    with tempfile.TemporaryDirectory() as path:
        write_model(path, args)
        per: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for _ in range(args.runs):  # alternate, so drift hits both alike
            for name, options in configs.items():
                per[name].append(run_once(path, args, prompts, options))
    for name, runs in per.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        result[name] = med
        if not args.json:
            print(name, json.dumps(med))
    if args.json:
        emit_json(result)


if __name__ == "__main__":
    main()
