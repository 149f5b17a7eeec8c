"""Per-step scheduler trace (``--scheduler-trace PATH``): JSON lines a user can plot
(scripts/plot_trace.py) or replay through the scheduler alone (engine_core/sched/replay.py).

Every line is one object with a "type" and a "seq": the order in which the scheduler saw the
call, so a replay makes the same calls in the same order (with async scheduling, step k+1 is
planned before step k's output is applied, and arrivals fall in between).

  header   once: format version, the EngineConfig, KV blocks, max_model_len, token budget,
           eos id and the KV cache groups (kind, window, layers; full attention first)
  arrival  add_request: request id, prompt token ids, sampling params, priority, cache salt
  abort    finish_requests from outside (aborts): the ids and the finish reason
  step     one schedule() call; written once its model output is applied, so it carries the
           step's wall time when the engine core measured it ("done_seq": the update's seq)
  finish   a request ended: reason, output length and output token ids (what a replay's fake
           model must produce)

With the KV offload tiers the header names their sizes ("kv_offload") and each step
record carries the tiers' counts ("kv_offload": hits, copies per direction and occupancy, all
decisions) and, when the workers reported disk reads with the step's output, the report
("kv_load": [done host slots, failed host slots]): read times are the disk's, so a replay
takes them from the trace to reach the same decisions.

With the continuum policy, arrival, abort and step records carry the scheduler clock's
reading ("clock"; a step's update: "done_clock"), so a replay feeds its pins the same time, and
each step record lists the pin events since the previous step ("pins": [event, job id, blocks
held, detail]: pin (detail: TTL s), claim (tokens saved), expire, pressure (released to make
room), replaced, end, abort, shutdown).

The scheduler calls in only behind ``if self.trace is not None``: off, the trace costs one
attribute test per call.
"""

from __future__ import annotations

import time
from typing import IO, TYPE_CHECKING, Any

import msgspec

from engine_core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine_core.sched.continuum.policy import Continuum
    from engine_core.sched.interface import SchedulerView
    from engine_core.sched.step_diff import StepDiff

TRACE_VERSION = 1
FLUSH_INTERVAL_S = 1.0  # a killed engine core loses at most this much of the trace
WRITE_BUFFER = 1 << 20
# the keys of a step record that are decisions (deterministic for a given call sequence);
# "t", "wall_s" and the seqs are not
DECISION_KEYS = (
    "step",
    "budget_used",
    "running",
    "waiting",
    "preempted",
    "decisions",
    "preemptions",
    "groups",
    "prefix_queries",
    "prefix_hits",
    "kv_offload",
    "pins",
)
# the KV offload counters a step record carries (per step, except the occupancy)
_OFFLOAD_DELTAS = ("host_hits", "disk_hits", "offloaded", "spilled", "dropped", "declined",
                   "load_failures")
_OFFLOAD_BYTES = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")


def trace_header(sched: SchedulerView) -> dict[str, Any]:
    kvm = sched.kv_cache_manager
    return {
        "type": "header",
        "seq": 0,
        "version": TRACE_VERSION,
        "t": time.time(),
        "config": msgspec.to_builtins(sched.config),
        "num_blocks": kvm.num_blocks,
        "block_size": sched.block_size,
        "max_model_len": sched.max_model_len,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "eos_token_id": sched.eos_token_id,
        # one entry per KV cache group; each step's "groups" list follows this order
        # (the groups share one pool of num_blocks blocks)
        "groups": [
            {
                "kind": spec.kind,
                "block_size": sched.block_size,
                "num_blocks": kvm.num_blocks,
                "sliding_window": spec.sliding_window,
                "layer_ids": list(spec.layer_ids),
            }
            for spec in kvm.kv_cache_groups
        ],
        **_offload_header(sched),
    }


def _offload_header(sched: SchedulerView) -> dict[str, Any]:
    if sched.kv_offload is None:
        return {}
    off = sched.kv_offload.offload
    return {"kv_offload": {"num_host_blocks": off.host.num_slots,
                           "num_disk_blocks": off.disk.num_slots,
                           "bytes_per_block": off.bytes_per_block}}


class SchedulerTrace:
    """Writes the trace of one scheduler to a path or a binary file object."""

    def __init__(self, out: str | IO[bytes], header: dict[str, Any]) -> None:
        self._own = isinstance(out, str)
        # a large buffer: a step line of a big batch is several KB, and the default 8 KB
        # buffer would make nearly every line a write() call
        self._f: IO[bytes] = (
            open(out, "wb", buffering=WRITE_BUFFER) if isinstance(out, str) else out
        )
        self._enc = msgspec.json.Encoder()
        self._buf = bytearray()  # reused for every line
        self._seq = 1
        self._pending: dict[int, dict[str, Any]] = {}  # scheduled steps not yet applied
        self._reqs: dict[str, Request] = {}  # unfinished requests, for their finish record
        self._preempted: set[str] = set()  # preempted and waiting to resume
        self._prefix = (0, 0)  # prefix-cache queries and hits at the last step
        self._freed: list[int] = []  # blocks freed by windows per group at the last step
        self._offload_last: dict[str, int] = {}  # KV offload counters at the last step
        self._last_flush = time.monotonic()
        # the continuum policy (set by the scheduler): its clock readings and pin events
        self.continuum: Continuum | None = None
        self._write(header)

    def _write(self, rec: dict[str, Any]) -> None:
        if self.continuum is not None and rec["type"] in ("arrival", "abort"):
            rec["clock"] = self.continuum.now
        buf = self._buf
        self._enc.encode_into(rec, buf)
        buf.extend(b"\n")
        self._f.write(buf)

    def _next_seq(self) -> int:
        seq = self._seq
        self._seq = seq + 1
        return seq

    # ------------------------------------------------------------------ events

    def on_arrival(self, req: Request, refused: bool) -> None:
        sp = req.sampling_params
        self._write(
            {
                "type": "arrival",
                "seq": self._next_seq(),
                "t": time.time(),
                "rid": req.request_id,
                "arrival_time": req.arrival_time,
                "prompt_len": req.num_prompt_tokens,
                "prompt": req.prompt_token_ids,
                "max_tokens": sp.max_tokens,
                "sampling_params": msgspec.to_builtins(sp),
                "eos_token_id": req.eos_token_id,
                "priority": req.priority,
                "cache_salt": req.cache_salt,
                **_job_fields(req),
                **_lora_fields(req),
            }
        )
        if refused:
            self._finish_record(req, "error")
        else:
            self._reqs[req.request_id] = req

    def on_abort(self, request_ids: list[str], reason: str) -> None:
        self._write(
            {
                "type": "abort",
                "seq": self._next_seq(),
                "t": time.time(),
                "rids": request_ids,
                "reason": reason,
            }
        )

    def on_finish(self, req: Request, reason: str) -> None:
        """A request ended (any path: sampled a stop, length, abort, capped in schedule())."""
        if self._reqs.pop(req.request_id, None) is not None:
            self._preempted.discard(req.request_id)
            self._finish_record(req, reason)

    def _finish_record(self, req: Request, reason: str) -> None:
        self._write(
            {
                "type": "finish",
                "seq": self._next_seq(),
                "t": time.time(),
                "rid": req.request_id,
                "reason": reason,
                "output_len": len(req.output_token_ids),
                "output_token_ids": req.output_token_ids,
                "num_preemptions": req.num_preemptions,
            }
        )

    # ------------------------------------------------------------------ steps

    def on_schedule(self, sched: SchedulerView, diff: StepDiff, step_id: int) -> None:
        """Record one schedule() call's decisions; written when its output is applied."""
        new = {d.handle: d.num_scheduled_tokens for d in diff.new_reqs}
        resumed = {d.handle: d.num_scheduled_tokens for d in diff.resumed_reqs}
        overrides = diff.overrides
        decisions: list[list[Any]]
        if not new and not resumed and not overrides:  # steady decoding: one token each
            decisions = [[req.request_id, "running", 1] for req in sched.running]
        else:
            decisions = []
            for req in sched.running:  # admission order, the newly admitted last
                h = req.handle
                if h in new:
                    decisions.append([req.request_id, "new", new[h]])
                elif h in resumed:
                    decisions.append([req.request_id, "resumed", resumed[h]])
                    self._preempted.discard(req.request_id)
                else:
                    n = overrides.get(h, 1)  # type: ignore[arg-type]
                    if n:
                        decisions.append([req.request_id, "running", n])
        by_handle = sched.by_handle
        for h in diff.preempted:
            rid = by_handle[h].request_id
            decisions.append([rid, "preempted", 0])
            self._preempted.add(rid)
        kvm = sched.kv_cache_manager
        queries, hits = kvm.prefix_cache_queries, kvm.prefix_cache_hits
        last_queries, last_hits = self._prefix
        self._prefix = (queries, hits)
        num_preempted = len(self._preempted)
        freed_total = kvm.num_freed_by_window
        last_freed = self._freed or [0] * len(freed_total)
        self._freed = list(freed_total)
        free = kvm.num_free_blocks
        cached = kvm.block_pool.num_cached_blocks
        self._pending[step_id] = {
            "type": "step",
            "seq": self._next_seq(),
            "done_seq": None,
            "step": step_id,
            "t": time.time(),
            "wall_s": None,
            "budget": sched.max_num_batched_tokens,
            "budget_used": diff.total,
            # queue lengths after this step's decisions; waiting excludes the preempted ones
            "running": len(sched.running),
            "waiting": len(sched.waiting) - num_preempted,
            "preempted": num_preempted,
            "decisions": decisions,
            "preemptions": len(diff.preempted),
            # one entry per KV cache group (header "groups"); free counts cached-but-evictable
            # blocks of the shared pool, cached = the group's blocks registered in the prefix
            # cache (in use or free), freed_by_window = blocks the group's window gave back
            # while this step was planned (and since the previous step)
            "groups": [
                {
                    "free": free,
                    "cached": cached[g],
                    "freed_by_window": freed_total[g] - last_freed[g],
                }
                for g in range(len(freed_total))
            ],
            "prefix_queries": queries - last_queries,  # tokens looked up this step
            "prefix_hits": hits - last_hits,  # of those, tokens found
        }
        if sched.kv_offload is not None:
            self._pending[step_id]["kv_offload"] = self._offload_record(sched)
        enc = getattr(sched, "encoder", None)
        if enc is not None:  # images: the encoder's work this step and its cache
            self._pending[step_id]["encoder"] = enc.trace_record(diff.encoder)
        conn = getattr(sched, "kv_connector", None)
        if conn is not None:  # P/D: requests waiting for their KV, loads, leases
            self._pending[step_id]["kv_connector"] = conn.trace_record()
        cont = self.continuum
        if cont is not None and cont.events is not None:
            self._pending[step_id]["clock"] = cont.now
            self._pending[step_id]["pins"], cont.events = cont.events, []

    def _offload_record(self, sched: SchedulerView) -> dict[str, int]:
        """This step's tier hits and copies (blocks), and the tiers' occupancy after it."""
        off = sched.kv_offload
        assert off is not None
        c = off.offload.counters
        now = {k: c[k] for k in _OFFLOAD_DELTAS}
        for k in _OFFLOAD_BYTES:
            now[k] = c.get(f"{k}_blocks", 0)
        now["restored_tokens"] = off.num_restored_tokens
        last = self._offload_last
        rec = {k: v - last.get(k, 0) for k, v in now.items()}
        self._offload_last = now
        rec["host_blocks"] = len(off.offload.host)
        rec["disk_blocks"] = len(off.offload.disk)
        return rec

    def set_wall_time(self, step_id: int, wall_s: float) -> None:
        """The engine core's measure of the step: schedule start to the model output."""
        rec = self._pending.get(step_id)
        if rec is not None:
            rec["wall_s"] = wall_s

    def on_update(self, step_id: int, kv_load: list[list[int]] | None = None) -> None:
        """The step's model output has been applied (its finishes are already written);
        ``kv_load``: the disk reads the workers reported with it (done, failed host slots)."""
        rec = self._pending.pop(step_id, None)
        if rec is not None:
            rec["done_seq"] = self._next_seq()
            if self.continuum is not None:
                rec["done_clock"] = self.continuum.now
            if kv_load is not None:
                rec["kv_load"] = kv_load
            self._write(rec)
        now = time.monotonic()
        if now - self._last_flush >= FLUSH_INTERVAL_S:
            self._last_flush = now
            self._f.flush()

    def close(self) -> None:
        """Write the steps still in flight (no done_seq) and close the file."""
        for step_id in sorted(self._pending):
            self._write(self._pending.pop(step_id))
        self._f.flush()
        if self._own:
            self._f.close()


def _job_fields(req: Request) -> dict[str, Any]:
    """An arrival's job (only when it has one: no bytes otherwise)."""
    if req.job_id is None:
        return {}
    return {"job": [req.job_id, req.is_last_step, req.tool_name]}


def _lora_fields(req: Request) -> dict[str, Any]:
    """An arrival's LoRA adapter (only when it has one): name, id, path, content hash."""
    lora = req.lora
    if lora is None:
        return {}
    return {"lora": [lora.lora_name, lora.lora_int_id, lora.lora_path, req.lora_hash]}


def finish_reason_status(reason: str) -> RequestStatus:
    """The finished status an abort record's reason stands for."""
    return {
        "abort": RequestStatus.FINISHED_ABORTED,
        "error": RequestStatus.FINISHED_ERROR,
        "stop": RequestStatus.FINISHED_STOPPED,
        "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    }[reason]
