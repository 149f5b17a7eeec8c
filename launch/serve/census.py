"""The HTTP frontend's census (GET /census): its maps that grow with client input, and the
whole engine's put together (launch/census.py).

Per-request: the engine client's tracked requests and the queue bound's slots, the server's
routes (request id -> stream queue) and the live Generations with what each holds per choice
(detokenizer, stop-string state, buffered stream events). Bounded: the metrics' label sets and
the frontend's compiled-grammar cache.
"""

from __future__ import annotations

import gc
import os
from typing import Any

from launch.census import assemble, leftovers
from launch.serve import generation
from launch.serve.context import ServerContext


def server_census(ctx: ServerContext) -> dict[str, int]:
    """{map: size} of this process. Collects garbage first: a Generation kept only by a
    reference cycle is garbage, not a leak, and must not count as live."""
    gc.collect()
    live = list(generation.LIVE)
    choices = [c for g in live for c in g.choices]
    out = ctx.engine.client.census()
    out.update({
        "serve.routes": ctx.engine.num_in_flight,
        "serve.generations": len(live),
        "serve.choices": len(choices),
        "serve.detokenizers": sum(c.detok is not None for c in choices),
        "serve.stop_text_chars": sum(len(c.stop.text) for c in choices),
        "serve.stream_buffered": sum(g.queue.qsize() for g in live),
        "serve.metric_label_sets": ctx.metrics.num_label_sets(),
    })
    grammars = ctx.grammars
    if grammars is not None and grammars.cache is not None:
        # the compiled-grammar cache's entries (bounded by that cache's own budget)
        out["serve.grammar_cache"] = len(grammars.cache)
    return out


async def census_body(ctx: ServerContext) -> dict[str, Any]:
    """GET /census: every process's sizes, the per-request maps that are not empty
    ("leftovers": none when idle), the KV free-block count, and the processes' pids."""
    report = await ctx.engine.stats(max_age_s=0.0)
    census = assemble(server_census(ctx), report)
    pids = {"frontend": os.getpid()}
    pids.update({c.name: c.proc.pid for c in ctx.engine.llm.group.children})
    return {
        "census": census,
        "leftovers": leftovers(census),
        "num_free_blocks": int(report.stats.get("num_free_blocks", -1)),
        "num_blocks": ctx.engine.num_blocks,
        "pids": pids,
    }
