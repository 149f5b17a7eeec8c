"""The scheduler with the KV offload tiers, against a fingerprinting fake worker.

The worker (fake_worker.py) keeps a fingerprint of the prefix ending at every KV slot and
checks every prefix a request is told is computed; here it also runs each step's tier copies
(in the wire contract's order, before the step's KV writes) on a simulated host pool and disk,
and reports disk reads one step later (some failed, on request). So a restore that brings back
the wrong block, a copy out of a block the step overwrites first, or a read of a record that was
never confirmed shows up as stale KV; outputs must equal a run without KV pressure.
"""

from __future__ import annotations

import random

import pytest

from engine_core.kv_offload import KVOffloadManager
from engine_core.sched.scheduler import Scheduler
from protocol.codec import pack
from protocol.config import EngineConfig
from protocol.kv_transfer import KVLoadResult, decode_transfers
from protocol.messages import ModelRunnerOutput, SchedulerOutput
from tests.engine_core.fake_worker import (
    FakeWorker,
    make_request,
    run_async_to_completion,
    run_to_completion,
    tokens_of,
)

BS = 4


class TieredFakeWorker(FakeWorker):
    def __init__(self, block_size: int, fail_reads: frozenset[int] = frozenset()) -> None:
        super().__init__(block_size)
        self.host: dict[int, list[int | None]] = {}
        self.disk: dict[int, list[int | None]] = {}
        self.pending_reads: list[int] = []  # host slots whose disk read ends next step
        self.num_reads = 0
        self.fail_reads = fail_reads  # the n-th reads (0-based) fail
        self.copies = 0

    def _block(self, block_id: int) -> list[int | None]:
        return [self.kv.get((block_id, i)) for i in range(self.block_size)]

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        done, failed = [], []
        for s in self.pending_reads:  # reads started last step are reported now
            (failed if self.num_reads in self.fail_reads else done).append(s)
            self.num_reads += 1
            if failed and failed[-1] == s:
                self.host[s] = [-1] * self.block_size  # torn bytes: must never be read
        self.pending_reads = []
        if so.kv_transfers is not None:
            t = decode_transfers(so.kv_transfers)
            self.copies += len(t)
            for s, x in t.host_to_disk:  # 1st: snapshots
                self.disk[x] = list(self.host[s])
            for x, s in t.disk_to_host:  # 2nd: reads, confirmed next step
                self.host[s] = list(self.disk[x])
                self.pending_reads.append(s)
            for d, s in t.device_to_host:  # 3rd
                self.host[s] = self._block(d)
            for s, d in t.host_to_device:  # 4th, then the forward
                assert s not in self.pending_reads, "restore from a slot still loading"
                for i, fp in enumerate(self.host[s]):
                    if fp is None:
                        self.kv.pop((d, i), None)
                    else:
                        self.kv[(d, i)] = fp
        out = super().step(so)
        if done or failed:
            out.kv_load = KVLoadResult(done_host_slots=pack(done), failed_host_slots=pack(failed))
        return out


def _scheduler(num_blocks: int, host: int, disk: int = 0, **cfg: object) -> Scheduler:
    config = EngineConfig(debug_invariants=True, block_size=BS, **cfg)  # type: ignore[arg-type]
    offload = KVOffloadManager(host, disk, 64) if host else None
    return Scheduler(config, num_blocks, 256, 16, None, offload=offload)


def _conversations(turns: int, convs: int, seed: int) -> list[list[list[int]]]:
    """Prompts per turn; each turn extends the conversation's previous prompt (answers are
    left out: the fake model's answers are known only after the run, and a shared prefix is
    all the tiers need)."""
    rng = random.Random(seed)
    hist = [[rng.randrange(10, 900) for _ in range(9 + 3 * c)] for c in range(convs)]
    out = []
    for _ in range(turns):
        out.append([list(h) for h in hist])
        for h in hist:
            h.extend(rng.randrange(10, 900) for _ in range(5))
    return out


def _run(sched: Scheduler, worker: FakeWorker, turns: list[list[list[int]]],
         use_async: bool) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    run = run_async_to_completion if use_async else run_to_completion
    for t, prompts in enumerate(turns):
        for c, p in enumerate(prompts):
            sched.add_request(make_request(f"t{t}c{c}", p, max_tokens=6))
        for rid, outs in run(sched, worker).items():
            got[rid] = tokens_of(outs)
    return got


@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("gate", [False, True])
def test_host_tier_restores_evicted_prefixes(use_async: bool, gate: bool) -> None:
    turns = _conversations(4, 5, seed=1)
    ref = _run(_scheduler(400, 0), FakeWorker(BS), turns, use_async)
    sched = _scheduler(16, 64, scheduler_reserve_full_isl=gate, max_num_seqs=3)
    worker = TieredFakeWorker(BS)
    assert _run(sched, worker, turns, use_async) == ref
    st = sched.get_stats()
    assert st["kv_offload_host_hits"] > 0 and st["kv_offload_restored_tokens"] > 0, st
    assert st["kv_offload_offloaded"] > 0 and worker.copies > 0
    if gate:
        assert st["num_preemptions"] == 0


def test_preempted_requests_resume_from_the_host_tier() -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 900) for _ in range(14)] for _ in range(4)]
    ref_sched = _scheduler(400, 0)
    ref_worker = FakeWorker(BS)
    for i, p in enumerate(prompts):
        ref_sched.add_request(make_request(f"r{i}", p, max_tokens=20))
    ref = {k: tokens_of(v) for k, v in run_to_completion(ref_sched, ref_worker).items()}
    sched = _scheduler(20, 64)
    worker = TieredFakeWorker(BS)
    for i, p in enumerate(prompts):
        sched.add_request(make_request(f"r{i}", p, max_tokens=20))
    got = {k: tokens_of(v) for k, v in run_to_completion(sched, worker).items()}
    assert got == ref
    st = sched.get_stats()
    assert st["num_preemptions"] > 0 and st["kv_offload_preempt_offloaded"] > 0, st
    assert st["kv_offload_host_hits"] > 0, st


@pytest.mark.parametrize("fail_reads", [frozenset(), frozenset(range(0, 1000, 3))])
def test_disk_tier_reads_are_confirmed_before_restores(fail_reads: frozenset[int]) -> None:
    turns = _conversations(4, 5, seed=2)
    ref = _run(_scheduler(400, 0), FakeWorker(BS), turns, False)
    sched = _scheduler(16, 6, disk=200, max_num_seqs=3)
    worker = TieredFakeWorker(BS, fail_reads)
    assert _run(sched, worker, turns, False) == ref
    st = sched.get_stats()
    assert st["kv_offload_spilled"] > 0 and st["kv_offload_disk_hits"] > 0, st
    assert st["kv_offload_loads_in_flight"] == 0
    if fail_reads:
        assert st["kv_offload_load_failures"] > 0, st


def test_reset_prefix_cache_forgets_the_tiers() -> None:
    sched = _scheduler(16, 64)
    worker = TieredFakeWorker(BS)
    _run(sched, worker, _conversations(2, 5, seed=3), False)
    assert sched.get_stats()["kv_offload_host_blocks"] > 0
    assert sched.kv_cache_manager.reset_prefix_cache()
    assert sched.get_stats()["kv_offload_host_blocks"] == 0
