"""Structured outputs: what a JSON-schema constraint costs per step, and on the wire.

Runs the same decode workload unconstrained and with a JSON schema at batch 1, 16 and 64
(max_num_seqs = batch, so every step is one token for each request), the two alternating
--repeats times in one engine, and reports per-step time (the median over the repeats of each
run's TPOT median; the overhead compares the two medians), compile time cold and cached (the
frontend's xgrammar compile, the same code the workers run), and the wire bytes: the steady
decode diff is the same either way (the workers advance their own matchers), while a
scheduler-side matcher would send vocab/32 int32 words per constrained request every step.

    python scripts/bench_structured.py --model dummy:tiny --tokenizer DIR_OR_GGUF --json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_common import emit_json  # noqa: E402
from structured_wire import SCHEMA, wire  # noqa: E402

from launch import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402


def tpot_ms(llm: LLM, batch: int, out_len: int, spec: StructuredOutputsParams | None) -> float:
    prompts = [[5 + i % 50, 6, 7, 8] for i in range(batch)]
    sp = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True,
                        structured_outputs=spec)
    outs = llm.generate(prompts, sp, use_tqdm=False, timeout_s=600)
    return statistics.median(o.metrics.tpot for o in outs if o.metrics.tpot) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    result: dict[str, float] = {}
    spec = StructuredOutputsParams(json=SCHEMA)
    with LLM(model=args.model, tokenizer=args.tokenizer, max_num_seqs=max(batches)) as llm:
        grammars = llm._grammars()
        t = time.perf_counter()
        grammars.prepare([SamplingParams(structured_outputs=spec)])
        result["compile_cold_ms"] = (time.perf_counter() - t) * 1e3  # token table included
        other = StructuredOutputsParams(json=SCHEMA | {"title": "other"})
        t = time.perf_counter()
        grammars.prepare([SamplingParams(structured_outputs=other)])
        result["compile_cold_table_built_ms"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        grammars.prepare([SamplingParams(structured_outputs=spec)])
        result["compile_cached_ms"] = (time.perf_counter() - t) * 1e3
        tpot_ms(llm, 2, 4, spec)  # warm: every worker compiled the grammar
        for b in batches:
            runs = [(tpot_ms(llm, b, args.output_len, None),
                     tpot_ms(llm, b, args.output_len, spec)) for _ in range(args.repeats)]
            plain = statistics.median(r[0] for r in runs)
            constrained = statistics.median(r[1] for r in runs)
            result[f"step_ms_plain_b{b}"] = plain
            result[f"step_ms_json_b{b}"] = constrained
            result[f"overhead_b{b}"] = constrained / plain - 1.0
        vocab = llm.info.vocab_size
    for b in batches:
        for k, v in wire(vocab, b).items():
            result[f"{k}_b{b}"] = v
    for k, v in result.items():
        print(f"{k:45s} {v:.3f}")
    if args.json:
        emit_json(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
