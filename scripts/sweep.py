"""Sweep bench_throughput over TP sizes and batch sizes (each point a fresh subprocess).

    python scripts/sweep.py --tp 1 2 --batch-sizes 16 64 --repeats 3 --out sweep.json

Writes the JSON file (every run and the per-point medians) and, when matplotlib is importable
(`pip install tandem[plot]`), a PNG next to it: output tok/s and TPOT against TP, one line per
batch size. The last stdout line with --json is the same JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import emit_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MEDIAN_KEYS = ["output_tokens_per_s", "requests_per_s", "tpot_median_ms", "total_s"]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[64], help="number of prompts")
    p.add_argument("--repeats", type=int, default=1, help="runs per point; medians reported")
    p.add_argument("--out", default="sweep.json")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    # Everything else (--input-len, --dtype, --model, ...) goes to bench_throughput as is.
    return p.parse_known_args(argv)


def run_point(tp: int, batch: int, extra: list[str], timeout_s: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        os.path.join(HERE, "bench_throughput.py"),
        "-tp",
        str(tp),
        "--num-prompts",
        str(batch),
        "--json",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {tail}")
    return json.loads(lines[-1])


def sweep(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    for batch in args.batch_sizes:
        for tp in args.tp:
            got = [run_point(tp, batch, extra, args.timeout_s) for _ in range(args.repeats)]
            runs += got
            point: dict[str, Any] = {"tensor_parallel_size": tp, "batch_size": batch}
            for k in MEDIAN_KEYS:
                vals = [r[k] for r in got if r.get(k) is not None]
                point[k] = statistics.median(vals) if vals else None
            points.append(point)
            if not args.json:
                print(
                    f"TP={tp} batch={batch}: {point['output_tokens_per_s']:.0f} output tok/s, "
                    f"TPOT {point['tpot_median_ms']:.1f} ms (median of {args.repeats})",
                    flush=True,
                )
    return {"args": extra, "points": points, "runs": runs}


def plot(result: dict[str, Any], path: str) -> str | None:
    """PNG of throughput and TPOT against TP; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for batch in sorted({p["batch_size"] for p in result["points"]}):
        pts = sorted(
            (p for p in result["points"] if p["batch_size"] == batch),
            key=lambda p: p["tensor_parallel_size"],
        )
        tps = [p["tensor_parallel_size"] for p in pts]
        ax1.plot(tps, [p["output_tokens_per_s"] for p in pts], marker="o", label=f"{batch} reqs")
        ax2.plot(tps, [p["tpot_median_ms"] for p in pts], marker="o", label=f"{batch} reqs")
    ax1.set(xlabel="tensor parallel size", ylabel="output tokens/s", title="throughput")
    ax2.set(xlabel="tensor parallel size", ylabel="TPOT median (ms)", title="time per token")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    result = sweep(args, extra)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    png = None if args.no_plot else plot(result, os.path.splitext(args.out)[0] + ".png")
    result["json_path"] = os.path.abspath(args.out)
    result["png_path"] = png
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    if args.json:
        emit_json(result)
    else:
        print(f"wrote {args.out}" + (f" and {png}" if png else " (no matplotlib: no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
