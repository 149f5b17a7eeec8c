"""Wire bytes of disaggregated prefill / decode (the KV connector's part of the step diff), for
profile_ipc.py: two real schedulers with connectors (a prefill P and a decode D) run prompts
through the handover, with the ranks' reports simulated; every byte the connector adds to the
step diffs is counted, per step and per request. The KV itself never crosses these sockets
(it goes rank to rank), so these are block ids, addresses and lease keys only.
"""

from __future__ import annotations

import random
import time

import msgspec

from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Encoder, pack
from protocol.config import EngineConfig
from protocol.kv_connector import KVConnectorReport, KVTransferConfig, KVTransferParams
from protocol.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from protocol.request_options import RequestOptions

_MP = msgspec.msgpack.Encoder()
ENC = Encoder()


def _engine(name: str, tp: int) -> Scheduler:
    cfg = KVTransferConfig()
    sched = Scheduler(EngineConfig(prefix_hash="fast", kv_transfer_config=cfg), 8192, 8192,
                      8192)
    sched.kv_connector = KVConnectorScheduler(
        cfg, sched.kv_cache_manager, engine_id=name, host="10.0.0.1", port=17000,
        rank_ports=[17001 + r for r in range(tp)], world_size=tp)
    return sched


def _step(sched: Scheduler, rng: random.Random) -> SchedulerOutput:
    so = sched.schedule()
    handles = [r.handle for r in sched.running if r.num_computed_tokens >= r.num_tokens]
    out = ModelRunnerOutput(step_id=so.step_id, rank=0, req_handles=pack(handles),
                            sampled_token_ids=pack([rng.randrange(1, 32000) for _ in handles]))
    sched.update_from_output(so, out)
    return so


def connector_bytes(so: SchedulerOutput) -> int:
    """What the connector's field costs in this diff (a nil byte when it has nothing)."""
    return len(_MP.encode(so.kv_connector))


def pd_wire(num_requests: int = 16, prompt_len: int = 1024, tp: int = 2) -> dict[str, float]:
    rng = random.Random(0)
    p, d = _engine("P", tp), _engine("D", tp)
    prompts = [[rng.randrange(1, 32000) for _ in range(prompt_len)] for _ in range(num_requests)]
    p_bytes: list[int] = []
    d_bytes: list[int] = []
    params: dict[str, KVTransferParams] = {}
    for i, prompt in enumerate(prompts):
        p.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=1), None, time.time(),
                              RequestOptions(kv_transfer_params=KVTransferParams(
                                  do_remote_decode=True))))
    while p.has_unfinished_requests():
        so = p.schedule()
        p_bytes.append(connector_bytes(so))
        handles = [r.handle for r in p.running if r.num_computed_tokens >= r.num_tokens]
        out = ModelRunnerOutput(step_id=so.step_id, rank=0, req_handles=pack(handles),
                                sampled_token_ids=pack([7] * len(handles)))
        for o in p.update_from_output(so, out):
            if o.kv_transfer_params is not None:
                params[o.request_id] = o.kv_transfer_params
    rep_bytes = 0
    for i, prompt in enumerate(prompts):
        d.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=4), None, time.time(),
                              RequestOptions(kv_transfer_params=params[f"r{i}"])))
    while d.has_unfinished_requests():
        so = _step(d, rng)
        d_bytes.append(connector_bytes(so))
        if so.kv_connector is not None and so.kv_connector.loads:
            ids = [op.load_id for op in so.kv_connector.loads]
            for rank in range(tp):  # every rank reports its part
                rep = KVConnectorReport(rank=rank, done=pack(ids), nbytes=1 << 20,
                                        seconds=[0.01] * len(ids), transport="tcp")
                rep_bytes += len(ENC.encode(rep))
                assert d.kv_connector is not None
                d.kv_connector.on_report(rep)
    assert d.kv_connector is not None and p.kv_connector is not None
    for _, msg in d.kv_connector.take_control():  # D says it is done: P ends the leases
        p.kv_connector.on_control(msg)
    p_bytes.append(connector_bytes(p.schedule()))  # the step that stops serving them
    p_total, d_total = sum(p_bytes) - len(p_bytes), sum(d_bytes) - len(d_bytes)  # minus nils
    answer = len(msgspec.msgpack.encode(next(iter(params.values()))))
    return {
        "pd_prompt_len": prompt_len,
        "pd_tp": tp,
        # above the one nil byte every step pays for the field
        "pd_prefill_diff_bytes_per_request": p_total / num_requests,
        "pd_decode_diff_bytes_per_request": d_total / num_requests,
        "pd_report_bytes_per_request": rep_bytes / num_requests,
        "pd_params_bytes": answer,
        "pd_idle_step_field_bytes": 1,
        # what one rank would move per request through the engine core if KV went that way
        "pd_kv_bytes_per_request_dummy_tiny_fp32": prompt_len * 4 * 2 * 4 * 64 * 4 // tp,
    }
