"""The engine core's census: the size of every map or list that grows with client input.

Two kinds (README, "Bounds: what grows with client input"):
- per-request state, keyed by request id or handle: it is freed with its request (finish,
  abort, error), so on an idle engine every one of these is 0;
- bounded caches (BOUNDED): they outlive requests but cannot pass their bound.

The frontend asks for it through the health report (HealthReport.census), which also carries
each rank's own census (workers/census.py) as "rank<R>.<name>".
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine_core.pens.base import HoldingPen
    from engine_core.sched.scheduler import Scheduler
    from engine_core.worker_link import WorkerLink


class CoreState(Protocol):
    """What the census reads of EngineCore (a protocol, so this module need not import it)."""

    inflight: set[str]
    pens: list[HoldingPen]
    in_flight: deque[Any]
    early_outputs: dict[int, Any]
    scheduler: Scheduler
    link: WorkerLink

# names below that are bounded rather than freed with their request, and their bound
BOUNDED = {
    "grammar_gate.grammars": "--structured-outputs-cache-mb of compiled grammars on each rank",
    "kv.prefix_hash_index": "one entry per cached block: at most num_blocks per KV group",
    "continuum.jobs": "MAX_JOBS (65536) jobs, oldest forgotten first",
    "continuum.pins": "one per job, and only while its blocks fit the KV cache",
    "continuum.gaps_by_job": "MAX_SCOPES (4096) jobs x WINDOW (64) gaps",
    "continuum.gaps_by_tool": "MAX_SCOPES (4096) tools x WINDOW (64) gaps",
    "kv_offload.host_entries": "the host tier's slots (--kv-offload-memory / block bytes)",
    "kv_offload.disk_entries": "the disk tier's slots (--kv-offload-disk-size / block bytes)",
    "kv_offload.loads": "the host tier's slots (one read per destination slot)",
    # adapters are registered by the operator (--lora-modules, the load endpoint behind
    # TANDEM_ALLOW_RUNTIME_LORA_UPDATING) or a Python API caller, never by an HTTP request's
    # body alone; each stays until it is unloaded
    "lora.adapters": "the adapters registered and not unloaded",
    "lora.slots": "max_loras",
    # sockets to prefill engines that clients' kv_transfer_params named (P/D)
    "kv_connector.peers": "MAX_PEERS (64), each closed after PEER_IDLE_S without a lease",
    # images: encoder outputs kept for reuse, at most --encoder-cache-size embeddings
    "encoder.entries": "--encoder-cache-size embeddings (at least one per entry)",
}


def core_census(core: CoreState) -> dict[str, int]:
    """{map: size} for this process; cheap (len() of each), so every health report has it."""
    sched = core.scheduler
    kvm = sched.kv_cache_manager
    out = {
        "frontend.inflight": len(core.inflight),
        "core.steps_in_flight": len(core.in_flight),
        "core.early_outputs": len(core.early_outputs),
        "scheduler.requests": len(sched.requests),
        "scheduler.waiting": len(sched.waiting),
        "scheduler.running": len(sched.running),
        "scheduler.by_handle": len(sched.by_handle),
        # handles the workers are still to be told to forget (sent with the next step)
        "scheduler.finished_handles": len(sched._finished_handles),
        "scheduler.pending_outputs": len(sched._pending_outputs),
        "scheduler.spec_by_step": len(sched.spec_by_step),
        "kv.req_to_blocks": sum(len(m.req_to_blocks) for m in kvm.managers),
        "kv.num_cached_block": sum(len(m.num_cached_block) for m in kvm.managers),
        "kv.first_live": sum(len(getattr(m, "first_live", ())) for m in kvm.managers),
        "kv.prefix_hash_index": len(kvm.block_pool.cached_block_hash_to_block),
    }
    if sched.trace is not None:
        out["trace.requests"] = len(sched.trace._reqs)
        out["trace.pending_steps"] = len(sched.trace._pending)
    cont = sched.continuum
    if cont is not None:
        out["continuum.jobs"] = len(cont.jobs)
        out["continuum.pins"] = len(cont.pins)
        out["continuum.gaps_by_job"] = len(cont.gaps.by_job)
        out["continuum.gaps_by_tool"] = len(cont.gaps.by_tool)
    offload = sched.kv_offload
    if offload is not None:
        out["kv_offload.prefetch_waits"] = len(offload._waits)
        out["kv_offload.host_entries"] = len(offload.offload.host)
        out["kv_offload.disk_entries"] = len(offload.offload.disk)
        out["kv_offload.loads"] = len(offload.offload._loads)
    slots = sched.lora
    if slots is not None:
        out["lora.slots"] = len(slots.slot_of)
        out["lora.slot_pins"] = len(slots.pins)
    enc = sched.encoder
    if enc is not None:
        out["encoder.entries"] = len(enc.cache.sizes)
        out["encoder.readers"] = len(enc.reading)  # requests reading cached outputs
    conn = sched.kv_connector
    if conn is not None:
        out["kv_connector.loads"] = len(conn.loads)
        out["kv_connector.remote_leases"] = len(conn.remote.refs)
    for pen in core.pens:  # what each enabled feature's holding pen keeps
        out.update(pen.census())
    for rank, sizes in sorted(core.link.rank_census.items()):
        out.update({f"rank{rank}.{name}": n for name, n in sizes.items()})
    return out
