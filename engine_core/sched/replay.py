"""Replay a scheduler trace (trace.py) through the scheduler alone.

The trace's arrivals, aborts, schedule() and update_from_output() calls are made again in their
recorded order ("seq"), on a scheduler built from the trace's header. A fake worker, driven only
by the step diffs as a real one is, returns each request's recorded output tokens, so stops,
lengths, prefix-cache hits on generated text and n-gram drafts come out as they did. Compared
with the recorded step records (DECISION_KEYS), the replay shows whether a scheduler reproduces
the run; with config overrides, how a scheduling change would have treated the same arrivals.

KV offload tiers: the scheduler gets the trace header's tier sizes, and each step's output
carries the disk-read report the workers sent with it (recorded: read times are the disk's).
With overrides the replayed steps differ from the recorded ones, so there every read in flight
is reported done with the next step's output instead.

Not reproduced exactly: sampled (not greedy) speculative decoding, where a rejected draft can be
replaced by the same token (the replay then counts it as accepted).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine_core.kv_offload import KVOffloadManager
from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from engine_core.sched.trace import (
    DECISION_KEYS,
    SchedulerTrace,
    finish_reason_status,
    trace_header,
)
from protocol.codec import pack, unpack
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.kv_transfer import KVLoadResult
from protocol.lora import LoRARequest
from protocol.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from protocol.request_options import JobInfo, RequestOptions


@dataclass
class Trace:
    header: dict[str, Any]
    # ("arrival" | "abort" | "schedule" | "update", record), in the recorded call order
    actions: list[tuple[str, dict[str, Any]]]
    steps: dict[int, dict[str, Any]]
    outputs: dict[str, list[int]]  # request id -> its recorded output tokens


def read_trace(lines: list[bytes] | list[str]) -> Trace:
    dec = msgspec.json.Decoder()
    header: dict[str, Any] | None = None
    keyed: list[tuple[int, str, dict[str, Any]]] = []
    steps: dict[int, dict[str, Any]] = {}
    outputs: dict[str, list[int]] = {}
    for line in lines:
        if not line.strip():
            continue
        rec = dec.decode(line)
        kind = rec["type"]
        if kind == "header":
            header = rec
        elif kind in ("arrival", "abort"):
            keyed.append((rec["seq"], kind, rec))
        elif kind == "step":
            steps[rec["step"]] = rec
            keyed.append((rec["seq"], "schedule", rec))
            if rec["done_seq"] is not None:
                keyed.append((rec["done_seq"], "update", rec))
        elif kind == "finish":
            outputs[rec["rid"]] = rec["output_token_ids"]
    if header is None:
        raise ValueError("not a scheduler trace: no header line")
    keyed.sort(key=lambda k: k[0])
    return Trace(header, [(kind, rec) for _, kind, rec in keyed], steps, outputs)


def load_trace(path: str) -> Trace:
    with open(path, "rb") as f:
        return read_trace(f.readlines())


@dataclass
class _Seq:
    rid: str
    length: int  # tokens the worker knows (prompt + outputs so far)
    computed: int
    num_out: int = 0


class ReplayWorker:
    """Applies step diffs like a worker and samples each request's recorded tokens."""

    def __init__(self, outputs: dict[str, list[int]]) -> None:
        self.outputs = outputs
        self.seqs: dict[int, _Seq] = {}
        self.running: set[int] = set()

    def _token(self, st: _Seq, i: int, stop_ids: frozenset[int]) -> int:
        rec = self.outputs.get(st.rid)
        if rec is not None and i < len(rec):
            return rec[i]
        # past the record (the run ended first, or async sampled one token past a stop):
        # anything that does not stop the request
        return next(t for t in range(len(stop_ids) + 1) if t not in stop_ids)

    def step(self, so: SchedulerOutput, sched: Scheduler) -> ModelRunnerOutput:
        by_handle = sched.by_handle  # handle -> request, to find the recorded tokens
        for h in unpack(so.finished_handles):
            self.seqs.pop(h, None)
            self.running.discard(h)
        for h in unpack(so.preempted_handles):
            self.running.discard(h)
        num: dict[int, int] = {h: 1 for h in self.running}
        for nr in so.new_reqs:
            rid = by_handle[nr.handle].request_id
            prompt_len = len(unpack(nr.prompt_token_ids))
            self.seqs[nr.handle] = _Seq(rid, prompt_len, nr.num_computed_tokens)
            self.running.add(nr.handle)
            num[nr.handle] = nr.num_scheduled_tokens
        for rr in so.resumed_reqs:
            self.seqs[rr.handle].computed = rr.num_computed_tokens
            self.running.add(rr.handle)
            num[rr.handle] = rr.num_scheduled_tokens
        for h, c in zip(
            unpack(so.sched_override_handles), unpack(so.sched_override_counts), strict=True
        ):
            num[h] = c
        drafts: dict[int, list[int]] = {}
        flat = unpack(so.spec_token_ids)
        pos = 0
        for h, c in zip(unpack(so.spec_handles), unpack(so.spec_token_counts), strict=True):
            drafts[h] = flat[pos : pos + c]
            pos += c
        handles: list[int] = []
        toks: list[int] = []
        counts: list[int] = []
        for h, n in num.items():
            if n == 0:
                continue
            st = self.seqs[h]
            st.computed += n
            d = drafts.get(h, [])
            if st.computed != st.length + len(d):
                continue  # a partial prefill chunk samples nothing
            req = by_handle.get(h)
            stop = req.stop_ids if req is not None else frozenset()
            # greedy verification against the record: drafts count while they match it
            accepted = 0
            while accepted < len(d) and d[accepted] == self._token(st, st.num_out + accepted, stop):
                accepted += 1
            new = d[:accepted] + [self._token(st, st.num_out + accepted, stop)]
            st.computed -= len(d) - accepted
            st.length += len(new)
            st.num_out += len(new)
            handles.append(h)
            toks.extend(new)
            counts.append(len(new))
        return ModelRunnerOutput(
            step_id=so.step_id,
            rank=0,
            req_handles=pack(handles),
            num_tokens=pack(counts) if any(c != 1 for c in counts) else b"",
            sampled_token_ids=pack(toks),
        )


@dataclass
class ReplayResult:
    recorded: list[dict[str, Any]]  # the trace's step records, in step order
    replayed: list[dict[str, Any]]  # the replay's own step records
    # (step, key, recorded value, replayed value) for every differing decision
    mismatches: list[tuple[int, str, Any, Any]] = field(default_factory=list)
    step_us: list[float] = field(default_factory=list)  # schedule + update per step
    stats: dict[str, float] = field(default_factory=dict)


class ReplayClock:
    """The scheduler clock of a replay: the reading the trace recorded for each call."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def set(self, rec: dict[str, Any], key: str = "clock") -> None:
        value = rec.get(key)
        if value is not None:
            self.now = value


def build_scheduler(header: dict[str, Any], overrides: dict[str, Any] | None = None,
                    clock: ReplayClock | None = None) -> Scheduler:
    cfg = dict(header["config"])
    cfg.update(overrides or {})
    cfg["scheduler_trace"] = None  # the replay records into memory, not over the trace
    config = msgspec.convert(cfg, EngineConfig)
    # the model's KV cache groups (older traces name none: one full-attention group)
    groups = [
        KVCacheGroupSpec(g.get("sliding_window", 0), tuple(g.get("layer_ids", ())))
        for g in header.get("groups", ())
    ]
    off = header.get("kv_offload")
    offload = None
    if off is not None and config.kv_offload_memory > 0:
        offload = KVOffloadManager(off["num_host_blocks"], off["num_disk_blocks"],
                                   off["bytes_per_block"])
    return Scheduler(
        config,
        header["num_blocks"],
        header["max_model_len"],
        header["max_num_batched_tokens"],
        header["eos_token_id"],
        kv_cache_groups=groups or None,
        offload=offload,
        clock=clock or ReplayClock(),
    )


def _loads_in_flight(sched: Scheduler) -> KVLoadResult | None:
    """Every disk read in flight, reported done (the replay with overrides)."""
    off = sched.kv_offload
    if off is None or not off.offload.num_loads_in_flight:
        return None
    return KVLoadResult(done_host_slots=pack(sorted(off.offload._loads)))


def replay(trace: Trace, overrides: dict[str, Any] | None = None) -> ReplayResult:
    """Make the trace's calls again; with ``overrides`` (EngineConfig fields) the scheduler
    differs, so steps after the recorded ones may be needed: the replay then keeps stepping
    until every request is done."""
    clock = ReplayClock()
    sched = build_scheduler(trace.header, overrides, clock)
    sink = io.BytesIO()
    sched.trace = SchedulerTrace(sink, trace_header(sched))
    sched.connect_trace()
    worker = ReplayWorker(trace.outputs)
    in_flight: dict[int, tuple[SchedulerOutput, ModelRunnerOutput]] = {}
    step_map: dict[int, int] = {}  # recorded step id -> replayed step id
    step_us: list[float] = []
    sp_type = SamplingParams
    for kind, rec in trace.actions:
        clock.set(rec, "done_clock" if kind == "update" else "clock")
        if kind == "arrival":
            job = rec.get("job")
            lora = rec.get("lora")
            req = Request(
                rec["rid"],
                rec["prompt"],
                msgspec.convert(rec["sampling_params"], sp_type),
                rec["eos_token_id"],
                rec["arrival_time"],
                RequestOptions(
                    priority=rec["priority"],
                    cache_salt=rec["cache_salt"],
                    job=JobInfo(job_id=job[0], is_last_step=job[1], tool_name=job[2])
                    if job else None,
                    lora=LoRARequest(*lora[:3]) if lora else None),
            )
            if lora:
                req.lora_hash = lora[3]
            sched.add_request(req)
        elif kind == "abort":
            sched.finish_requests(rec["rids"], finish_reason_status(rec["reason"]))
        elif kind == "schedule":
            if overrides and not sched.has_unfinished_requests():
                continue  # a changed scheduler finished early: nothing to plan
            t0 = time.perf_counter()
            so = sched.schedule()
            step_us.append((time.perf_counter() - t0) * 1e6)
            in_flight[so.step_id] = (so, worker.step(so, sched))
            step_map[rec["step"]] = so.step_id
        else:  # update
            sid = step_map.pop(rec["step"], None)
            if sid is None:
                continue
            so, out = in_flight.pop(sid)
            if not overrides and "kv_load" in rec:
                done, failed = rec["kv_load"]
                out.kv_load = KVLoadResult(done_host_slots=pack(done),
                                           failed_host_slots=pack(failed))
            elif overrides:
                out.kv_load = _loads_in_flight(sched)
            t0 = time.perf_counter()
            sched.update_from_output(so, out)
            step_us[sid] += (time.perf_counter() - t0) * 1e6
            sched.take_outputs()
    for so, out in (in_flight.pop(k) for k in sorted(in_flight)):  # steps never applied
        sched.update_from_output(so, out)
    extra = 0
    while sched.has_unfinished_requests() and overrides:  # a changed scheduler needs more
        t0 = time.perf_counter()
        so = sched.schedule()
        out = worker.step(so, sched)
        out.kv_load = _loads_in_flight(sched)
        t1 = time.perf_counter()
        sched.update_from_output(so, out)
        step_us.append((t1 - t0 + time.perf_counter() - t1) * 1e6)
        sched.take_outputs()
        extra += 1
        if extra > 10 * len(trace.steps) + 10_000:
            raise RuntimeError("the replayed scheduler does not finish the trace's requests")
    stats = sched.get_stats()
    sched.close()
    replayed = sorted(
        read_trace(sink.getvalue().splitlines()).steps.values(), key=lambda r: r["step"]
    )
    recorded = [trace.steps[k] for k in sorted(trace.steps)]
    return ReplayResult(recorded, replayed, compare(recorded, replayed), step_us, stats)


def compare(
    recorded: list[dict[str, Any]], replayed: list[dict[str, Any]]
) -> list[tuple[int, str, Any, Any]]:
    """Every decision that differs, step by step; a missing step counts as one mismatch."""
    out: list[tuple[int, str, Any, Any]] = []
    for i in range(max(len(recorded), len(replayed))):
        a = recorded[i] if i < len(recorded) else None
        b = replayed[i] if i < len(replayed) else None
        if a is None or b is None:
            out.append((i, "step", a is not None, b is not None))
            continue
        for key in DECISION_KEYS:
            if a.get(key) != b.get(key):
                out.append((a["step"], key, a.get(key), b.get(key)))
    return out
