"""The connector's scheduler side between two real schedulers (prefill P, decode D), each
driving a FakeWorker whose simulated KV holds a fingerprint of the prefix at every slot. The
"transfer" copies P's fingerprints into D's blocks as the load ops name them, so a wrong block
mapping shows up as stale KV on D, and D's greedy tokens must equal one engine's.

Every scenario ends with both pools' free-block counts back at their totals.
"""

from __future__ import annotations

import pytest

from engine_core.kv_connector.scheduler_side import KVConnectorScheduler
from engine_core.request import Request, RequestStatus
from engine_core.sched.scheduler import Scheduler
from protocol.codec import pack, unpack
from protocol.kv_connector import (
    KVConnectorReport,
    KVTransferConfig,
    KVTransferParams,
    check_ops,
)
from protocol.messages import EngineCoreOutput, SamplingParams
from protocol.request_options import RequestOptions
from tests.engine_core.fake_worker import FakeWorker, make_scheduler, run_to_completion

BS = 4
NUM_BLOCKS = 48


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Engine:
    """A scheduler with a connector and a fake worker, stepped by hand."""

    def __init__(self, name: str, clock: Clock, policy: str = "recompute") -> None:
        self.cfg = KVTransferConfig(kv_load_failure_policy=policy, kv_lease_s=30.0,
                                    kv_transfer_timeout_s=20.0)
        self.sched: Scheduler = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BS,
                                               kv_transfer_config=self.cfg)
        self.conn = KVConnectorScheduler(
            self.cfg, self.sched.kv_cache_manager, engine_id=name, host="127.0.0.1",
            port=1000 if name == "P" else 2000, rank_ports=[1001], world_size=1, clock=clock)
        self.sched.kv_connector = self.conn
        self.worker = FakeWorker(BS)
        self.outs: dict[str, list[EngineCoreOutput]] = {}
        self.exposed: set[str] = set()
        self.loads: list = []  # load ops not yet run

    def step(self) -> None:
        s = self.sched
        so = s.schedule()
        meta = so.kv_connector
        if meta is not None:
            check_ops(meta)
            self.exposed |= {e.key for e in meta.expose}
            self.exposed -= set(meta.unexpose)
            self.loads += meta.loads
        for o in s.update_from_output(so, self.worker.step(so)) + s.take_outputs():
            self.outs.setdefault(o.request_id, []).append(o)
        s.check_invariants()

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outs.get(rid, []) for t in o.new_token_ids]

    def final(self, rid: str) -> EngineCoreOutput:
        return self.outs[rid][-1]

    @property
    def all_free(self) -> bool:
        return self.sched.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 1


def settle(p: Engine, d: Engine) -> None:
    """What the engine cores' loops do: deadlines, lease messages from D to P."""
    for e in (p, d):
        e.conn.tick()
    for (_, _, engine_id), msg in d.conn.take_control():
        assert engine_id == "P"
        p.conn.on_control(msg)


def transfer(p: Engine, d: Engine, fail: bool = False) -> None:
    """Run D's pending loads: copy P's KV fingerprints block for block, report to D."""
    for op in d.loads:
        ok = not fail and op.remote_key in p.exposed
        if ok:
            for src, dst in zip(unpack(op.remote_block_ids), unpack(op.block_ids), strict=True):
                for slot in range(BS):
                    if (src, slot) in p.worker.kv:
                        d.worker.kv[(dst, slot)] = p.worker.kv[(src, slot)]
        rep = KVConnectorReport(rank=0, done=pack([op.load_id]) if ok else b"",
                                failed=b"" if ok else pack([op.load_id]),
                                reasons=[] if ok else ["refused"], nbytes=64, seconds=[0.01])
        d.conn.on_report(rep)
        d.conn.on_report(rep)  # a duplicate is ignored
    d.loads = []


def request(rid: str, prompt: list[int], max_tokens: int,
            params: KVTransferParams | None = None) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), None, 0.0,
                   RequestOptions(kv_transfer_params=params))


def run(p: Engine, d: Engine, steps: int = 200) -> None:
    for _ in range(steps):
        settle(p, d)
        busy = False
        for e in (p, d):
            if e.sched.has_unfinished_requests():
                e.step()
                busy = True
        if d.loads:
            transfer(p, d)
            busy = True
        if not busy:
            return
    raise AssertionError("did not settle")


def prefill(p: Engine, rid: str, prompt: list[int]) -> KVTransferParams:
    p.sched.add_request(request(rid, prompt, 1, KVTransferParams(do_remote_decode=True)))
    while p.sched.has_unfinished_requests():
        p.step()
    params = p.final(rid).kv_transfer_params
    assert params is not None and params.do_remote_prefill
    return params


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    s = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BS)
    s.add_request(request("ref", prompt, max_tokens))
    outs = run_to_completion(s, FakeWorker(BS))
    return [t for o in outs["ref"] for t in o.new_token_ids]


@pytest.fixture
def pair() -> tuple[Engine, Engine, Clock]:
    clock = Clock()
    return Engine("P", clock), Engine("D", clock), clock


@pytest.mark.parametrize("n", [1, BS - 1, BS, BS + 1, 5 * BS + 2])
def test_decode_side_generates_what_one_engine_does(pair, n: int) -> None:
    p, d, _ = pair
    prompt = [11 + (7 * i) % 90 for i in range(n)]
    params = prefill(p, "r", prompt)
    assert p.tokens("r") == reference(prompt, 1)
    assert len(p.conn.leases) == 1 and not p.all_free
    d.sched.add_request(request("r", prompt, 6, params))
    run(p, d)
    assert d.tokens("r") == reference(prompt, 6)
    # every prompt token but the last came over (n = 1: nothing to load)
    assert d.final("r").num_cached_tokens == n - 1
    assert d.conn.stats.loaded_tokens == n - 1
    assert len(p.conn.leases) == 0 and p.conn.stats.leases_released == 1
    assert p.all_free and d.all_free


def test_decode_side_prefix_hit_loads_only_the_rest(pair) -> None:
    p, d, _ = pair
    prompt = list(range(20, 20 + 6 * BS + 1))
    d.sched.add_request(request("warm", prompt[: 3 * BS] + [99], 1))  # D caches 3 blocks
    run(p, d)
    params = prefill(p, "r", prompt)
    d.sched.add_request(request("r", prompt, 5, params))
    run(p, d)
    assert d.tokens("r") == reference(prompt, 5)
    assert d.conn.stats.loaded_tokens == len(prompt) - 1 - 3 * BS
    assert d.final("r").num_cached_tokens == len(prompt) - 1
    # a full hit: D computed this prompt already, so nothing is pulled and P is released
    params = prefill(p, "again", prompt)
    d.sched.add_request(request("again", prompt, 5, params))
    run(p, d)
    assert d.tokens("again") == reference(prompt, 5)
    assert d.conn.stats.transfers == 1
    assert p.all_free and d.all_free and not p.conn.leases


def test_aborts_at_every_stage_free_both_pools(pair) -> None:
    p, d, clock = pair
    prompt = list(range(30, 30 + 3 * BS + 2))
    # before P finishes: no lease, no params
    p.sched.add_request(request("a", prompt, 1, KVTransferParams(do_remote_decode=True)))
    p.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert p.sched.take_outputs()[0].kv_transfer_params is None
    # between P and D: D aborts while queued (before its load started): P is released
    params = prefill(p, "b", prompt)
    d.sched.add_request(request("b", prompt, 4, params))
    d.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    settle(p, d)
    assert not p.conn.leases
    # mid-transfer: the load is planned, D aborts; its blocks wait for the ranks' reports
    params = prefill(p, "c", prompt)
    d.sched.add_request(request("c", prompt, 4, params))
    d.step()
    assert d.sched.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    assert not d.all_free  # a rank may still be writing them
    settle(p, d)
    assert not p.conn.leases
    d.step()  # carries the load and its cancel
    transfer(p, d)  # the ranks report (the remote refused: the lease is gone)
    d.step()
    assert d.all_free
    # D never arrives: the lease runs out
    prefill(p, "e", prompt)
    clock.t += 31.0
    settle(p, d)
    assert p.conn.stats.leases_expired == 1
    p.step()  # unexposes it
    assert "e#5" not in p.exposed and p.all_free and d.all_free


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_applies_the_policy(policy: str) -> None:
    clock = Clock()
    p, d = Engine("P", clock), Engine("D", clock, policy=policy)
    prompt = list(range(40, 40 + 4 * BS))
    params = prefill(p, "r", prompt)
    d.sched.add_request(request("r", prompt, 5, params))
    d.step()
    transfer(p, d, fail=True)
    run(p, d)
    if policy == "recompute":
        assert d.tokens("r") == reference(prompt, 5)
        assert d.final("r").num_cached_tokens == 0
    else:
        assert d.final("r").finish_reason == "error"
        assert "rank 0: refused" in (d.final("r").error or "")
    assert d.conn.stats.failed == 1
    assert p.all_free and d.all_free


def test_timeout_cancels_and_recomputes(pair) -> None:
    p, d, clock = pair
    prompt = list(range(50, 50 + 2 * BS + 1))
    params = prefill(p, "r", prompt)
    d.sched.add_request(request("r", prompt, 3, params))
    d.step()
    clock.t += 21.0
    settle(p, d)
    so = d.sched.schedule()  # the cancel goes out
    assert so.kv_connector is not None
    assert unpack(so.kv_connector.cancel) == [d.loads[0].load_id]
    d.sched.update_from_output(so, d.worker.step(so))
    transfer(p, d)  # the rank finished after all: the scheduler gave it up, still failed
    d.conn.on_report(KVConnectorReport(rank=0, done=pack([12345])))  # unknown: ignored
    run(p, d)
    assert d.tokens("r") == reference(prompt, 3)
    assert d.conn.stats.timeouts == 1
    assert p.all_free and d.all_free


def test_bad_params_are_refused_with_the_field_named(pair) -> None:
    _, d, _ = pair
    bad = KVTransferParams(do_remote_prefill=True, remote_engine_id="P", remote_host="h",
                           remote_port=1, remote_rank_ports=[2], tp_size=1,
                           remote_request_id="k", remote_num_tokens=9, remote_block_ids=[1])
    d.sched.add_request(request("x", list(range(1, 10)), 2, bad))
    out = d.sched.take_outputs()[0]
    assert out.finish_reason == "error" and "remote_block_ids" in (out.error or "")


def test_trace_shows_the_wait(tmp_path) -> None:
    import json

    clock = Clock()
    p, d = Engine("P", clock), Engine("D", clock)
    path = str(tmp_path / "trace.jsonl")
    d.sched = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BS, kv_transfer_config=d.cfg,
                             scheduler_trace=path)
    d.conn = KVConnectorScheduler(d.cfg, d.sched.kv_cache_manager, engine_id="D",
                                  host="127.0.0.1", port=2000, rank_ports=[1001], world_size=1,
                                  clock=clock)
    d.sched.kv_connector = d.conn
    prompt = list(range(60, 60 + 3 * BS))
    params = prefill(p, "r", prompt)
    d.sched.add_request(request("r", prompt, 2, params))
    d.step()  # admitted aside, its load planned
    d.step()  # still waiting: nothing was transferred
    run(p, d)
    d.sched.close()
    steps = [json.loads(line) for line in open(path) if '"step"' in line]
    recs = [s["kv_connector"] for s in steps if s.get("type") == "step"]
    assert recs[0]["started"] == 1 and recs[0]["waiting_for_remote_kvs"] == 1
    assert recs[1]["waiting_for_remote_kvs"] == 1 and recs[1]["loads_in_flight"] == 1
    assert sum(r["done"] for r in recs) == 1 and recs[-1]["waiting_for_remote_kvs"] == 0


def test_remote_leases_are_renewed_while_waiting_and_released_once() -> None:
    from engine_core.kv_connector.loads import RemoteLeases

    clock = Clock()
    leases = RemoteLeases(30.0, clock)
    p = KVTransferParams(do_remote_prefill=True, remote_engine_id="P", remote_host="h",
                         remote_port=9, remote_request_id="k1", remote_lease_s=8.0)
    leases.hold("a", p)
    assert leases.take_messages() == []  # nothing due yet
    clock.t += 2.5  # a quarter of the remote lease (8 s / 4 = 2 s) has passed
    (addr, msg), = leases.take_messages()
    assert addr == ("h", 9, "P") and msg.renew == ["k1"] and msg.release == []
    leases.release("a")
    leases.release("a")  # twice: one release
    (_, msg), = leases.take_messages()
    assert msg.release == ["k1"] and msg.renew == []
    clock.t += 10
    assert leases.take_messages() == []
