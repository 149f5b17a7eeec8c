"""Worker host overhead: apply the step diff + build model inputs, at N decoding requests.

Compares the persistent InputBatch (vectorized numpy, diff-driven) with a naive baseline that
keeps Python lists and rebuilds every input from them each step. No forward pass: this is the
per-step CPU work a worker does before the model runs.

    python scripts/bench_worker.py --json   # last stdout line: {"prep_us": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from protocol.codec import pack, unpack  # noqa: E402
from protocol.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from workers.runner.input_batch import InputBatch  # noqa: E402


def make_plan(num_reqs: int, context: int, bs: int, steps: int) -> list[SchedulerOutput]:
    """Step 0 admits everyone (prefix hit: one token left to compute); then steady decodes.

    Contexts are staggered so about 1/bs of the requests cross a block boundary each step and
    get one new block, as in a real decode batch.
    """
    ctx = [context + (i % bs) for i in range(num_reqs)]
    next_block = 1
    blocks: list[list[int]] = []
    new = []
    for h in range(num_reqs):
        n_blocks = -(-ctx[h] // bs)
        ids = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        blocks.append(ids)
        new.append(
            NewRequestData(
                handle=h,
                prompt_token_ids=pack([(h * 31 + j) % 30000 for j in range(ctx[h])]),
                sampling_params=SamplingParams(temperature=0.0),
                block_ids=pack(ids),
                num_computed_tokens=ctx[h] - 1,
                num_scheduled_tokens=1,
            )
        )
    plan = [
        SchedulerOutput(
            step_id=0, new_reqs=new, num_running=num_reqs, total_num_scheduled_tokens=num_reqs
        )
    ]
    length = list(ctx)  # tokens each request holds; the next step computes position length
    for step in range(1, steps + 1):
        for h in range(num_reqs):
            length[h] += 1  # the token sampled last step
        grow = [h for h in range(num_reqs) if length[h] > len(blocks[h]) * bs]
        ids = list(range(next_block, next_block + len(grow)))
        next_block += len(grow)
        for h, b in zip(grow, ids, strict=True):
            blocks[h].append(b)
        plan.append(
            SchedulerOutput(
                step_id=step,
                cached_reqs=CachedRequestData(pack(grow), pack([1] * len(grow)), pack(ids)),
                num_running=num_reqs,
                total_num_scheduled_tokens=num_reqs,
            )
        )
    return plan


def bench_batch(plan: list[SchedulerOutput], num_reqs: int, max_len: int, bs: int) -> list[float]:
    batch = InputBatch(num_reqs, max_len, bs)
    times = []
    for so in plan:
        t0 = time.perf_counter()
        batch.apply(so)
        inp = batch.prepare_inputs()
        tensors = [
            torch.from_numpy(a)
            for a in (
                inp.input_ids, inp.positions, inp.slot_mapping, inp.query_start_loc,
                inp.seq_lens, inp.block_table, inp.logits_indices,
            )
        ]  # fmt: skip
        t1 = time.perf_counter()
        times.append((t1 - t0) * 1e6)
        del tensors
        sampled = (inp.positions[inp.logits_indices] % 30000).astype(np.int32)
        batch.update_after_step(inp, sampled)
    return times[1:]  # step 0 is admission, not a steady decode step


class NaiveWorker:
    """Python lists per request, every input rebuilt from scratch each step."""

    def __init__(self, bs: int) -> None:
        self.bs = bs
        self.reqs: dict[int, dict] = {}
        self.order: list[int] = []

    def apply(self, so: SchedulerOutput) -> None:
        for nr in so.new_reqs:
            self.reqs[nr.handle] = {
                "tokens": unpack(nr.prompt_token_ids),
                "computed": nr.num_computed_tokens,
                "blocks": unpack(nr.block_ids),
                "n": nr.num_scheduled_tokens,
            }
            self.order.append(nr.handle)
        cr = so.cached_reqs
        ids = unpack(cr.new_block_ids)
        start = 0
        for h, c in zip(unpack(cr.handles), unpack(cr.new_block_counts), strict=True):
            self.reqs[h]["blocks"].extend(ids[start : start + c])
            start += c

    def build(self) -> list[torch.Tensor]:
        bs = self.bs
        input_ids, positions, slots, qsl, seq_lens, rows, logits_idx = [], [], [], [0], [], [], []
        width = 0
        for h in self.order:
            r = self.reqs[h]
            c, n, toks, blocks = r["computed"], r["n"], r["tokens"], r["blocks"]
            for p in range(c, c + n):
                input_ids.append(toks[p])
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(c + n)
            if c + n >= len(toks):
                logits_idx.append(qsl[-1] - 1)
            rows.append(blocks)
            width = max(width, -(-(c + n) // bs))
        table = [(b + [0] * width)[:width] for b in rows]
        return [
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            torch.tensor(slots, dtype=torch.int64),
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(table, dtype=torch.int32),
            torch.tensor(logits_idx, dtype=torch.int64),
        ]

    def after_step(self) -> None:
        for h in self.order:
            r = self.reqs[h]
            r["computed"] += r["n"]
            r["tokens"].append(r["computed"] % 30000)
            r["n"] = 1


def bench_naive(plan: list[SchedulerOutput], bs: int) -> list[float]:
    w = NaiveWorker(bs)
    times = []
    for so in plan:
        t0 = time.perf_counter()
        w.apply(so)
        tensors = w.build()
        t1 = time.perf_counter()
        times.append((t1 - t0) * 1e6)
        del tensors
        w.after_step()
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-reqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bs = args.block_size
    plan = make_plan(args.num_reqs, args.context, bs, args.steps)
    max_len = args.context + bs + args.steps + 1
    prep, naive = [], []
    for _ in range(args.runs):
        prep.append(statistics.median(bench_batch(plan, args.num_reqs, max_len, bs)))
        naive.append(statistics.median(bench_naive(plan, bs)))
    result = {
        "prep_us": round(statistics.median(prep), 2),
        "naive_prep_us": round(statistics.median(naive), 2),
        "speedup": round(statistics.median(naive) / statistics.median(prep), 1),
        "prep_us_runs": [round(x, 2) for x in prep],
        "naive_prep_us_runs": [round(x, 2) for x in naive],
        "num_reqs": args.num_reqs,
        "context": args.context,
        "block_size": bs,
        "steps_per_run": args.steps,
    }
    if not args.json:
        print(
            f"{args.num_reqs} decoding requests, context ~{args.context}, block_size {bs}: "
            f"InputBatch {result['prep_us']} us/step, naive rebuild {result['naive_prep_us']} "
            f"us/step ({result['speedup']}x)"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
