"""A rank's census: the size of every map that grows with client input, sent with each health
pong so the engine core's census (engine_core/census.py) covers every process.

Per-request state is keyed by handle and freed when a step's diff lists the handle as
finished (the core sends an empty step for that when it goes idle), so on an idle engine it
is 0. BOUNDED names what outlives requests, and its bound. The input batch is counted here;
each feature counts its own maps (StepHook.census).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.runner.model_runner import ModelRunner

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
    # encoder outputs: exactly the engine core's account (encoder.entries), dropped as it says
    "encoder.outputs": "--encoder-cache-size embeddings, as the engine core decides",
}


def worker_census(runner: ModelRunner) -> dict[str, int]:
    """{map: size} for this rank; len() of each, cheap enough for every pong."""
    out: dict[str, int] = {}
    batch = runner.input_batch
    if batch is not None:
        out["input_batch.states"] = len(batch.states)
        out["input_batch.rows"] = batch.num_reqs
        out["input_batch.failed"] = len(batch.failed)
    for census in runner.hooks.census:
        census(out)
    return out
