"""IPC payload profiler: what the step plans cost on the wire, and how fast they fan out.

Drives the real Scheduler with synthetic workloads (fake one-token model outputs, no model)
and reports per message type and per field: bytes per step (median, p99), encode / decode
time, bytes over one request's lifetime, and broadcast latency from one PUB to N real
subscriber processes (receipt time minus send time on CLOCK_MONOTONIC, which is system-wide
on Linux, so two processes can compare it).

    python scripts/profile_ipc.py [--json] [--quick]

With --json the last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lora_wire import wire as lora_wire  # noqa: E402
from pd_wire import pd_wire  # noqa: E402
from structured_wire import bitmask_bytes, wire  # noqa: E402

from engine_core.request import Request  # noqa: E402
from engine_core.sched.scheduler import Scheduler  # noqa: E402
from protocol.codec import Encoder, broadcast_decoder, pack  # noqa: E402
from protocol.config import EngineConfig  # noqa: E402
from protocol.messages import (  # noqa: E402
    CachedRequestData,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from protocol.transport import (  # noqa: E402
    ipc_endpoints,
    make_socket,
    recv_frame,
    remove_ipc_dir,
    wait_subscribers,
)

VOCAB = 32000
ENC = Encoder()
_MP = msgspec.msgpack.Encoder()


# ------------------------------------------------------------------------------ driving


def make_scheduler(num_blocks: int, max_batched: int) -> Scheduler:
    cfg = EngineConfig(max_num_seqs=256, prefix_hash="fast")
    return Scheduler(cfg, num_blocks, 8192, max_batched, eos_token_id=None)


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int, rng: random.Random) -> None:
    prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    sched.add_request(Request(rid, prompt, sp, None, time.time()))


def fake_output(so: SchedulerOutput, sched: Scheduler, rng: random.Random) -> ModelRunnerOutput:
    """One sampled token for every request whose computation reached its last token."""
    handles = [r.handle for r in sched.running if r.num_computed_tokens >= r.num_tokens]
    tokens = [rng.randrange(1, VOCAB) for _ in handles]
    return ModelRunnerOutput(
        step_id=so.step_id, rank=0, req_handles=pack(handles), sampled_token_ids=pack(tokens)
    )


def step(sched: Scheduler, rng: random.Random) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    so = sched.schedule()
    mro = fake_output(so, sched, rng)
    sched.update_from_output(so, mro)
    sched.take_outputs()
    return so, mro


# ------------------------------------------------------------------------------ measuring


def field_sizes(msg: msgspec.Struct) -> dict[str, int]:
    return {f: len(_MP.encode(getattr(msg, f))) for f in msg.__struct_fields__}


def time_us(fn, frame_or_msg, n: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(5):  # best of 5 batches: the machine is shared, noise only adds time
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn(frame_or_msg)
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else 0.0


# ------------------------------------------------------------------------------ scenarios


def decode_scenario(rng: random.Random, steady_steps: int) -> dict:
    """256 running requests with staggered lengths, measured once all are decoding."""
    sched = make_scheduler(num_blocks=40_000, max_batched=8192)
    for i in range(256):
        add(sched, f"d{i}", rng.randrange(64, 576), 100_000, rng)
    # prefilling = more than the one freshly sampled token left to compute
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
        step(sched, rng)
    steps = [step(sched, rng) for _ in range(steady_steps)]
    assert all(so.num_running == 256 for so, _ in steps), "not a steady batch of 256"
    sizes = [len(ENC.encode(so)) for so, _ in steps]
    median_so = sorted((len(ENC.encode(so)), so.step_id, so) for so, _ in steps)[len(steps) // 2][2]
    frame = ENC.encode(median_so)
    dec = broadcast_decoder()
    return {
        "steps": steps,
        "decode_step_bytes": statistics.median(sizes),
        "decode_step_bytes_p99": pct(sizes, 99),
        # the same step had no request crossed a block boundary
        "decode_step_bytes_no_growth": len(
            ENC.encode(msgspec.structs.replace(median_so, cached_reqs=CachedRequestData()))
        ),
        "frame": frame,
        "encode_us": time_us(ENC.encode, median_so, 5000),
        "decode_us": time_us(dec.decode, frame, 5000),
    }


def admit_scenario(rng: random.Random) -> dict:
    sched = make_scheduler(num_blocks=4096, max_batched=8192)
    for i in range(8):
        add(sched, f"a{i}", 512, 16, rng)
    so = sched.schedule()
    assert len(so.new_reqs) == 8, "all 8 prompts must be admitted in one step"
    return {
        "admit_bytes": len(ENC.encode(so)),
        "admit_fields": field_sizes(so),
    }


def baseline(so: SchedulerOutput) -> int:
    return len(
        ENC.encode(
            SchedulerOutput(
                step_id=so.step_id,
                num_running=so.num_running,
                total_num_scheduled_tokens=so.total_num_scheduled_tokens,
            )
        )
    )


def lifetime_scenario(rng: random.Random) -> dict:
    """One request alone: every byte above an empty step plan is attributable to it."""
    sched = make_scheduler(num_blocks=4096, max_batched=2048)
    add(sched, "life", 2048, 500, rng)
    bc = ret = n = 0
    while sched.has_unfinished_requests():
        so, mro = step(sched, rng)
        bc += len(ENC.encode(so)) - baseline(so)
        empty = ModelRunnerOutput(step_id=mro.step_id, rank=0, req_handles=b"")
        ret += len(ENC.encode(mro)) - len(ENC.encode(empty))
        n += 1
    so = sched.schedule()  # the step that tells the workers to forget it
    bc += len(ENC.encode(so)) - baseline(so)
    return {
        "lifetime_bytes": bc,
        "lifetime_return_bytes": ret,
        "lifetime_steps": n,
    }


def mixed_workload(rng: random.Random, num_requests: int) -> list[tuple]:
    """Arrivals over time, varied prompt/output lengths, a KV cache that forces preemption."""
    sched = make_scheduler(num_blocks=3000, max_batched=2048)
    out = []
    arrived = 0
    while arrived < num_requests or sched.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):
            if arrived < num_requests:
                add(sched, f"m{arrived}", rng.randrange(16, 1024), rng.randrange(8, 400), rng)
                arrived += 1
        out.append(step(sched, rng))
    return out


def per_field_table(steps: list[tuple]) -> list[tuple[str, str, float, float]]:
    rows = []
    for idx, kind in ((0, "SchedulerOutput"), (1, "ModelRunnerOutput")):
        msgs = [s[idx] for s in steps]
        frames = [len(ENC.encode(m)) for m in msgs]
        rows.append((kind, "(frame)", statistics.median(frames), pct(frames, 99)))
        per: dict[str, list[int]] = {}
        for m in msgs:
            for f, size in field_sizes(m).items():
                per.setdefault(f, []).append(size)
        for f, vals in per.items():
            rows.append((kind, f, statistics.median(vals), pct(vals, 99)))
    return rows


# ------------------------------------------------------------------------------ broadcast


def subscriber_main(bc_addr: str, res_addr: str, rank: int, count: int) -> int:
    """Child process: timestamp every received frame, send the stamps back at the end."""
    from protocol.transport import answer_sync

    ctx = zmq.Context()
    sub = make_socket(ctx, zmq.SUB, bc_addr, bind=False)
    push = make_socket(ctx, zmq.PUSH, res_addr, bind=False, linger_ms=5000)
    dec = broadcast_decoder()
    try:
        nonce = answer_sync(sub, push, rank, 30.0)
        stamps: list[int] = []
        while len(stamps) < count:
            frame = recv_frame(sub, 30_000)
            t = time.monotonic_ns()
            if frame is None:
                return 2
            msg = dec.decode(frame)
            if isinstance(msg, SchedulerOutput):
                stamps.append(t)
            elif getattr(msg, "nonce", None) != nonce:
                return 3
        push.send(msgspec.msgpack.encode([rank, stamps]))
        return 0
    finally:
        sub.close()
        push.close()
        ctx.term()


def broadcast_latency(frame: bytes, n_subs: int, count: int, gap_s: float) -> list[float]:
    eps, path = ipc_endpoints()
    ctx = zmq.Context()
    pub = make_socket(ctx, zmq.PUB, eps.broadcast, bind=True)
    pull = make_socket(ctx, zmq.PULL, eps.results, bind=True)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    args = [eps.broadcast, eps.results]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--subscriber", *args, str(r), str(count)], env=env
        )
        for r in range(n_subs)
    ]
    try:
        wait_subscribers(pub, pull, n_subs, 60.0)
        time.sleep(0.05)  # let late sync pings drain
        so = broadcast_decoder().decode(frame)
        assert isinstance(so, SchedulerOutput)
        sent: list[int] = []
        for _ in range(count):
            t = time.monotonic_ns()
            pub.send(frame)
            sent.append(t)
            time.sleep(gap_s)  # one step per forward pass: latency, not queueing
        lat: list[float] = []
        for _ in range(n_subs):
            raw = recv_frame(pull, 60_000)
            if raw is None:
                raise TimeoutError("a subscriber never reported")
            _, stamps = msgspec.msgpack.decode(raw)
            lat += [(r - s) / 1000 for r, s in zip(stamps, sent, strict=True)]
        return lat
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        pub.close()
        pull.close()
        ctx.term()
        remove_ipc_dir(path)


# ------------------------------------------------------------------------------ main


# the structured-output comparison: dummy:tiny's vocabulary at the largest batch
STRUCTURED_VOCAB = 32000
STRUCTURED_BATCH = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke test)")
    ap.add_argument("--subscriber", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.subscriber:
        bc, res, rank, count = a.subscriber
        sys.exit(subscriber_main(bc, res, int(rank), int(count)))
    rng = random.Random(0)
    dec = decode_scenario(rng, steady_steps=32 if a.quick else 64)
    adm = admit_scenario(rng)
    life = lifetime_scenario(rng)
    mixed = mixed_workload(rng, 40 if a.quick else 300)
    count = 200 if a.quick else 1000
    bcast = {n: broadcast_latency(dec["frame"], n, count, 0.002) for n in (1, 2, 4, 8)}
    # structured outputs at batch 64 on dummy:tiny's vocabulary: worker-side matchers keep the
    # decode diff as is; a scheduler-side matcher would ship every constrained request's mask
    so_wire = wire(STRUCTURED_VOCAB, STRUCTURED_BATCH)
    # P/D: the KV connector's operations in the step diffs (block ids, never KV bytes)
    pd = pd_wire(num_requests=4 if a.quick else 16)
    # LoRA adapters: per adapter, per load, per request, and the decode step with adapters
    lw = lora_wire()

    print(f"{'message':<18} {'field':<26} {'median B':>9} {'p99 B':>9}   (mixed workload)")
    for kind, field, med, p99 in per_field_table(mixed):
        print(f"{kind:<18} {field:<26} {med:>9.0f} {p99:>9.0f}")
    print(f"\n{'admit step field':<45} {'bytes':>9}")
    for field, size in adm["admit_fields"].items():
        print(f"{field:<45} {size:>9}")
    print(f"\n{'figure':<45} {'value':>9} {'target':>9}")
    figures = [
        ("decode_step_bytes (batch 256, median)", dec["decode_step_bytes"], "<= 256"),
        ("decode_step_bytes p99", dec["decode_step_bytes_p99"], ""),
        ("decode_step_bytes (no block growth)", dec["decode_step_bytes_no_growth"], ""),
        ("admit_bytes (8 x 512-token prompts)", adm["admit_bytes"], "<= 9500"),
        ("lifetime_bytes (2048 + 500 tokens)", life["lifetime_bytes"], "<= 5000"),
        ("lifetime_return_bytes (rank 0 -> core)", life["lifetime_return_bytes"], ""),
        ("encode_us (decode step)", round(dec["encode_us"], 2), ""),
        ("decode_us (decode step)", round(dec["decode_us"], 2), "sum <= 10"),
        (f"structured decode diff, worker-side (batch {STRUCTURED_BATCH})",
         so_wire["decode_diff_bytes"], ""),
        ("structured decode diff, scheduler-side bitmask",
         so_wire["decode_diff_bytes_scheduler_side"], ""),
        ("P/D prefill diff bytes / request (1024 tok)",
         round(pd["pd_prefill_diff_bytes_per_request"], 1), ""),
        ("P/D decode diff bytes / request (1024 tok)",
         round(pd["pd_decode_diff_bytes_per_request"], 1), ""),
        ("P/D rank reports bytes / request (TP 2)",
         round(pd["pd_report_bytes_per_request"], 1), ""),
        ("LoRA PrepareLoRA per adapter (to every rank)", lw["prepare_lora_bytes"], ""),
        ("LoRA LoRAReady per adapter and rank", lw["lora_ready_bytes"], ""),
        ("LoRA LoRASlotOp per load", lw["slot_op_bytes"], ""),
        ("LoRA base request extra bytes", lw["base_request_extra_bytes"], "0"),
        ("LoRA adapter request extra bytes (pair)", lw["adapter_request_extra_bytes"], ""),
        (f"LoRA decode step, batch {int(lw['decode_batch'])} base",
         lw["decode_step_bytes_base"], ""),
        (f"LoRA decode step, {int(lw['decode_num_adapters'])} adapters",
         lw["decode_step_bytes_adapters"], "= base"),
    ]
    for name, value, target in figures:
        print(f"{name:<45} {value!s:>9} {target:>9}")
    print(f"\n{'broadcast (us)':<20} {'p50':>9} {'p99':>9}")
    for n, lat in bcast.items():
        print(f"{n} subscriber(s){'':<5} {pct(lat, 50):>9.1f} {pct(lat, 99):>9.1f}")
    if a.json:
        result = {
            "decode_step_bytes": dec["decode_step_bytes"],
            "decode_step_bytes_p99": dec["decode_step_bytes_p99"],
            "decode_step_bytes_no_growth": dec["decode_step_bytes_no_growth"],
            "admit_bytes": adm["admit_bytes"],
            "lifetime_bytes": life["lifetime_bytes"],
            "lifetime_return_bytes": life["lifetime_return_bytes"],
            "encode_us": round(dec["encode_us"], 3),
            "decode_us": round(dec["decode_us"], 3),
            "broadcast_p50_us": round(pct(bcast[4], 50), 1),
            "broadcast_p99_us": round(pct(bcast[4], 99), 1),
            "structured_vocab_size": STRUCTURED_VOCAB,
            "structured_batch": STRUCTURED_BATCH,
            "structured_decode_diff_bytes": so_wire["decode_diff_bytes"],
            "structured_decode_diff_bytes_scheduler_side":
                so_wire["decode_diff_bytes_scheduler_side"],
            "structured_bitmask_bytes_per_request": bitmask_bytes(STRUCTURED_VOCAB),
            "structured_new_request_bytes_plain": so_wire["new_request_bytes_plain"],
            "structured_new_request_bytes_constrained": so_wire["new_request_bytes_constrained"],
            "structured_prepare_grammar_bytes": so_wire["prepare_grammar_bytes"],
            "structured_grammar_ready_bytes": so_wire["grammar_ready_bytes"],
            **pd,
            **{f"lora_{k}": v for k, v in lw.items()},
            "broadcast_us": {
                str(n): {"p50": round(pct(v, 50), 1), "p99": round(pct(v, 99), 1)}
                for n, v in bcast.items()
            },
        }
        print(json.dumps(result))


if __name__ == "__main__":
    main()
