"""A rank's census: the size of every map that grows with client input, sent with each health
pong so the engine core's census (engine_core/census.py) covers every process.

Per-request state is keyed by handle and freed when a step's diff lists the handle as
finished (the core sends an empty step for that when it goes idle), so on an idle engine it
is 0. BOUNDED names what outlives requests, and its bound.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from workers.runner.model_runner import ModelRunner


class WorkerState(Protocol):
    """What the census reads of a Worker (a protocol: this module need not import it)."""

    runner: ModelRunner
    grammar_tickets: dict[int, tuple[Future[Any], tuple[str, str], int]]

BOUNDED = {
    # which grammars a rank keeps is decided by the engine core (DropGrammars), within
    # --structured-outputs-cache-mb
    "structured.grammar_cache": "--structured-outputs-cache-mb, as the engine core decides",
    "kv_offload.loading": "the host tier's slots",
    "kv_offload.bad_slots": "the host tier's slots",
    "kv_offload.disk_ops": "the disk tier's slots",
    "kv_offload.disk_reads": "the host tier's slots",
    # a decode rank's connections to the prefill ranks clients' kv_transfer_params named
    "kv_connector.peers": "the puller's MAX_PEERS (64), least recently used closed first",
}


def worker_census(worker: WorkerState) -> dict[str, int]:
    """{map: size} for this rank; len() of each, cheap enough for every pong."""
    runner = worker.runner
    out = {"grammar_tickets": len(worker.grammar_tickets)}
    batch = runner.input_batch
    if batch is not None:
        out["input_batch.states"] = len(batch.states)
        out["input_batch.rows"] = batch.num_reqs
        out["input_batch.failed"] = len(batch.failed)
    structured = runner.structured
    if structured is not None:
        out["structured.pending"] = len(structured.pending)
        out["structured.matchers"] = len(structured.matchers)
        out["structured.failed"] = len(structured.failed)
        out["structured.grammar_cache"] = len(structured.cache)
    offload = runner.kv_offload
    if offload is not None:
        out["kv_offload.loading"] = len(offload._loading)
        out["kv_offload.bad_slots"] = len(offload._bad)
        if offload.disk is not None:
            out["kv_offload.disk_ops"] = len(offload.disk._last_op)
            out["kv_offload.disk_reads"] = len(offload.disk._reads)
    kv = runner.kv_connector
    if kv is not None and kv.puller is not None:
        out["kv_connector.peers"] = kv.puller.num_peers
        out["kv_connector.loads"] = kv.puller.num_loads
    return out
