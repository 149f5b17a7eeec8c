"""Draw a scheduler trace (--scheduler-trace PATH) as a timeline PNG.

Four panels over the step id: queue lengths (running, waiting, preempted), KV usage per
cache group (used and prefix-cached blocks as shares of the group), prefix-cache hit rate
(this step's and cumulative, in tokens) and preemptions per step.

  python scripts/plot_trace.py trace.jsonl --out timeline.png [--json]

Needs matplotlib (pip install -e ".[plot]"). --json: the last stdout line is one JSON object
(out, steps, requests, preemptions, max_running, max_waiting, peak_kv_usage, prefix_hit_rate).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def read(path: str) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    header: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    arrivals = 0
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("type")
            if kind == "header":
                header = rec
            elif kind == "step":
                steps.append(rec)
            elif kind == "arrival":
                arrivals += 1
    if not header:
        raise SystemExit(f"{path}: not a scheduler trace (no header line)")
    steps.sort(key=lambda r: r["step"])
    return header, steps, arrivals


def summarize(header: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    queries = sum(r["prefix_queries"] for r in steps)
    hits = sum(r["prefix_hits"] for r in steps)
    usable = [g["num_blocks"] - 1 for g in header["groups"]]
    peak = 0.0
    for r in steps:
        for g, n in zip(r["groups"], usable, strict=True):
            peak = max(peak, 1.0 - g["free"] / max(1, n))
    return {
        "steps": len(steps),
        "preemptions": sum(r["preemptions"] for r in steps),
        "max_running": max((r["running"] for r in steps), default=0),
        "max_waiting": max((r["waiting"] + r["preempted"] for r in steps), default=0),
        "peak_kv_usage": round(peak, 4),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
    }


def plot(header: dict[str, Any], steps: list[dict[str, Any]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True)
    ax = axes[0]
    for key in ("running", "waiting", "preempted"):
        ax.plot(x, [r[key] for r in steps], label=key, linewidth=1)
    ax.set_ylabel("requests")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)

    ax = axes[1]
    for i, g in enumerate(header["groups"]):
        usable = max(1, g["num_blocks"] - 1)
        used = [1.0 - r["groups"][i]["free"] / usable for r in steps]
        cached = [r["groups"][i]["cached"] / usable for r in steps]
        ax.plot(x, used, label=f"group {i} ({g['kind']}) used", linewidth=1)
        ax.plot(x, cached, label=f"group {i} prefix-cached", linewidth=1, linestyle="--")
    ax.set_ylabel("share of KV blocks")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[2]
    step_x = [r["step"] for r in steps if r["prefix_queries"]]
    step_rate = [r["prefix_hits"] / r["prefix_queries"] for r in steps if r["prefix_queries"]]
    cum_q = cum_h = 0
    cum: list[float] = []
    for r in steps:
        cum_q += r["prefix_queries"]
        cum_h += r["prefix_hits"]
        cum.append(cum_h / cum_q if cum_q else 0.0)
    ax.scatter(step_x, step_rate, s=6, label="this step", alpha=0.6)
    ax.plot(x, cum, label="cumulative", linewidth=1, color="black")
    ax.set_ylabel("prefix hit rate")
    ax.set_ylim(-0.02, 1.05)
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[3]
    ax.bar(x, [r["preemptions"] for r in steps], width=1.0, color="tab:red")
    ax.set_ylabel("preemptions")
    ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("trace", help="a --scheduler-trace file")
    p.add_argument("--out", default=None, help="PNG path (default: the trace's name + .png)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    header, steps, arrivals = read(args.trace)
    try:
        plot(header, steps, out, os.path.basename(args.trace))
    except ImportError:
        sys.stderr.write('plot_trace.py needs matplotlib: pip install -e ".[plot]"\n')
        raise SystemExit(2) from None
    res = {"out": out, "requests": arrivals, **summarize(header, steps)}
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>16}: {v}")


if __name__ == "__main__":
    main()
