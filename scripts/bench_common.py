"""Shared helpers of the benchmark scripts: flags, workload, percentiles, breakdown, JSON output.

Every script prints, with --json, exactly one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_core.step_timeline import COLUMNS  # noqa: E402
from launch.args import add_engine_args, engine_options  # noqa: E402

# Phases of one engine step whose sum is the step's wall time (the core's own clock).
STEP_PHASES = ["schedule_us", "encode_us", "broadcast_us", "wait_us", "update_us", "emit_us"]
WORKER_PHASES = ["worker_prep_us", "worker_forward_us", "worker_sample_us"]
# rank 0's host time before each launch, hidden behind the device or not (worker overlap)
WORKER_HOST = ["worker_hidden_us", "worker_exposed_us"]
# a step that starts this long after the previous one ended found the engine idle
IDLE_GAP_S = 1e-3


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100) with linear interpolation, as numpy.percentile's default."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float], prefix: str, unit: str, scale: float = 1.0) -> dict:
    """{prefix_mean_unit, _median_, _p90_, _p95_, _p99_} of values * scale (NaN when empty)."""
    xs = [v * scale for v in values]
    out = {f"{prefix}_mean_{unit}": statistics.fmean(xs) if xs else math.nan}
    out[f"{prefix}_median_{unit}"] = percentile(xs, 50)
    for q in (90, 95, 99):
        out[f"{prefix}_p{q}_{unit}"] = percentile(xs, q)
    return out


# ---------------------------------------------------------------------------- flags / engine


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    add_engine_args(p, default_model="dummy:tiny")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="per-phase step timeline of the measured run and non_forward_fraction",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="torch.profiler Chrome trace per rank (trace_rank{r}.json) + step_timeline.json",
    )
    return p


def add_workload_args(p: argparse.ArgumentParser, num_prompts: int, in_len: int, out_len: int):
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--input-len", type=int, default=in_len)
    g.add_argument("--output-len", type=int, default=out_len)
    g.add_argument("--prompts-file", default=None, help="one text prompt per line")


def start_llm(args: argparse.Namespace) -> Any:
    """The engine (real processes) for these flags; no tokenizer for dummy models."""
    from launch.llm import LLM

    return LLM(
        args.model,
        tensor_parallel_size=args.tensor_parallel_size,
        load_tokenizer=bool(args.prompts_file) or not args.model.startswith("dummy:"),
        **engine_options(args),
    )


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[Any]:
    """Text lines of --prompts-file (cycled to --num-prompts) or random token-id prompts."""
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        if not lines:
            raise SystemExit(f"no prompts in {args.prompts_file}")
        return [lines[i % len(lines)] for i in range(args.num_prompts)]
    rng = random.Random(args.seed)
    return [
        [rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]


def sampling_params(args: argparse.Namespace) -> Any:
    from launch import SamplingParams

    return SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)


# ---------------------------------------------------------------------------- profiling


class Profiling:
    """--breakdown / --profile around the measured region.

    --breakdown turns on only the engine's step timeline (cheap); --profile also runs
    torch.profiler on every rank and writes its Chrome traces.
    """

    def __init__(self, llm: Any, args: argparse.Namespace) -> None:
        self.llm = llm
        self.breakdown = bool(args.breakdown)
        self.profile_dir: str | None = args.profile
        self.on = self.breakdown or self.profile_dir is not None
        self.rows: list[list[float]] = []

    def start(self) -> None:
        if not self.on:
            return
        if self.profile_dir is None:
            self.llm.start_profile(torch_profiler=False)
            return
        os.makedirs(self.profile_dir, exist_ok=True)
        self.llm.start_profile(os.path.abspath(self.profile_dir))

    def stop(self) -> dict[str, Any]:
        """Stop; save the timeline with --profile; the breakdown summary with --breakdown."""
        if not self.on:
            return {}
        stats = self.llm.stop_profile()
        self.rows = [list(r) for r in stats.step_timeline]
        if self.profile_dir is not None:
            path = os.path.join(self.profile_dir, "step_timeline.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"columns": COLUMNS, "rows": self.rows, "stats": stats.stats}, f)
            # Workers export their traces after the engine has answered: wait for the files.
            self._wait_for_traces(self.profile_dir, timeout_s=120.0)
        return breakdown_summary(self.rows) if self.breakdown else {}

    def _wait_for_traces(self, trace_dir: str, timeout_s: float) -> None:
        world = int(self.llm.config.tensor_parallel_size)
        paths = [os.path.join(trace_dir, f"trace_rank{r}.json") for r in range(world)]
        deadline = time.monotonic() + timeout_s
        last: list[int] = []
        while time.monotonic() < deadline:
            sizes = [os.path.getsize(p) if os.path.exists(p) else -1 for p in paths]
            if min(sizes) > 0 and sizes == last:  # all there and no longer growing
                return
            last = sizes
            time.sleep(0.2)
        print(f"warning: not every rank's trace appeared in {trace_dir}", file=sys.stderr)

    def close(self) -> None:
        """Nothing to release; kept so callers can close unconditionally."""


def breakdown_summary(rows: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Per-phase median µs over steps, and the share of step wall time that is not forward.

    A step's wall time is the time between the ends of consecutive steps (their outputs sent),
    so it counts everything the engine did per step, and it stays right with async
    scheduling, where a step is planned while the one before it runs. The first step, and a
    step that started after the engine sat idle, count from their own start instead.
    exposed host time = wall - worker forward; non_forward_fraction = 1 - sum(forward) /
    sum(wall); worker_hidden_fraction = the share of rank 0's host time between launches that
    ran while the device was still busy with the step before (worker overlap).
    """
    col = {name: i for i, name in enumerate(COLUMNS)}
    out: dict[str, Any] = {"steps": len(rows)}
    if not rows:
        out["non_forward_fraction"] = math.nan
        return out
    for name in STEP_PHASES + WORKER_PHASES + WORKER_HOST + ["num_tokens", "frame_bytes"]:
        key = name[:-3] + "_median_us" if name.endswith("_us") else name + "_median"
        out[key] = percentile([r[col[name]] for r in rows], 50)
    walls = []
    prev_end: float | None = None
    for r in rows:
        start, end = r[col["start_s"]], r[col["end_s"]]
        if prev_end is None or start > prev_end + IDLE_GAP_S:
            walls.append((end - start) * 1e6)
        else:
            walls.append((end - prev_end) * 1e6)
        prev_end = end
    fwd = [r[col["worker_forward_us"]] for r in rows]
    out["step_wall_median_us"] = percentile(walls, 50)
    out["exposed_host_median_us"] = percentile([w - f for w, f in zip(walls, fwd, strict=True)], 50)
    out["non_forward_fraction"] = 1.0 - sum(fwd) / sum(walls) if sum(walls) > 0 else math.nan
    hidden = sum(r[col["worker_hidden_us"]] for r in rows)
    host = hidden + sum(r[col["worker_exposed_us"]] for r in rows)
    out["worker_hidden_fraction"] = hidden / host if host > 0 else math.nan
    return out


def scheduler_summary(
    args: argparse.Namespace, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """Engine-mode keys and the scheduler counters of the measured region (after - before):
    preemptions, and with speculative decoding the acceptance rate and mean accepted length
    (tokens per verification, the model's own token included)."""

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out: dict[str, Any] = {
        "async_scheduling": bool(getattr(args, "async_scheduling", False)),
        # as asked: null = the default (on with async scheduling on CUDA)
        "worker_overlap": getattr(args, "worker_overlap", None),
        "num_preemptions": int(delta("num_preemptions")),
    }
    if getattr(args, "speculative_ngram", 0):
        drafts, accepted = delta("spec_num_draft_tokens"), delta("spec_num_accepted_tokens")
        verifications = delta("spec_num_verifications")
        out.update(
            speculative_ngram=args.speculative_ngram,
            num_speculative_tokens=args.num_speculative_tokens,
            spec_num_draft_tokens=int(drafts),
            spec_acceptance_rate=accepted / drafts if drafts else 0.0,
            spec_mean_accepted_len=1.0 + accepted / verifications if verifications else 1.0,
        )
    return out


def print_breakdown(summary: dict[str, Any]) -> None:
    if not summary:
        return
    print(f"step breakdown over {summary['steps']} steps (median µs per step):")
    for k, v in summary.items():
        if k.endswith("_median_us"):
            print(f"  {k.removesuffix('_median_us'):<16} {v:10.1f}")
    print(f"  non-forward share of step time: {summary['non_forward_fraction']:.3f}")
    print(f"  worker host time hidden behind the device: "
          f"{summary['worker_hidden_fraction']:.3f}")


# ---------------------------------------------------------------------------- output


def machine_info() -> dict[str, Any]:
    """The CPU this ran on: its model, core count and the flags that decide kernels and
    `--dtype auto` (AVX-512, native bf16, AMX)."""
    from workers.cpu_dtype import cpu_model_and_flags

    model, flags = cpu_model_and_flags()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
    return {"cpu_model": model, "cpu_count": os.cpu_count(),
            "cpu_flags": [f for f in wanted if f in flags]}


def emit_json(obj: dict[str, Any]) -> None:
    """The one JSON object, last on stdout (NaN becomes null so any parser reads it), with the
    machine's CPU model and flags."""
    obj = {**obj, **machine_info()}
    clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in obj.items()}
    sys.stdout.flush()
    print(json.dumps(clean), flush=True)
