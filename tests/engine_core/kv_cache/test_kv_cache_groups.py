"""KV cache groups through the real Scheduler: sliding-window and hybrid models.

A fake worker follows the wire diffs with one block table per group (protocol/messages.py: G
runs of equal length per request), writes a fingerprint of each computed position's prefix into
its slot in every group's table, and before computing a position checks every key that layer
kind can see: all earlier keys for full attention, the keys in (p - W, p) for a window of W. So
a block given back too early, a wrong prefix-cache hit or a wrong table on the wire shows up as
a wrong fingerprint, through chunked prefill, preemption and prefix hits.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine_core.request import Request
from engine_core.sched.scheduler import Scheduler
from protocol.codec import Decoder, Encoder, pack, unpack
from protocol.config import EngineConfig
from protocol.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups
from protocol.messages import ModelRunnerOutput, SamplingParams, SchedulerOutput
from tests.engine_core.fake_worker import next_token

BS = 4


@dataclass
class _Req:
    tokens: list[int]
    tables: list[list[int]]
    num_computed: int


class GroupWorker:
    def __init__(self, windows: list[int]) -> None:
        self.windows = windows
        self.reqs: dict[int, _Req] = {}
        self.running: set[int] = set()
        self.kv: dict[tuple[int, int], int] = {}
        self._enc, self._dec = Encoder(), Decoder(SchedulerOutput)

    def _split(self, ids: list[int]) -> list[list[int]]:
        g = len(self.windows)
        assert len(ids) % g == 0
        n = len(ids) // g
        return [ids[i * n : (i + 1) * n] for i in range(g)]

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        so = self._dec.decode(self._enc.encode(so))
        for h in unpack(so.finished_handles):
            self.reqs.pop(h)
            self.running.discard(h)
        for h in unpack(so.preempted_handles):
            self.running.discard(h)
            self.reqs[h].tables = [[] for _ in self.windows]
        sched: dict[int, int] = {}
        for nr in so.new_reqs:
            self.reqs[nr.handle] = _Req(unpack(nr.prompt_token_ids),
                                        self._split(unpack(nr.block_ids)), nr.num_computed_tokens)
            self.running.add(nr.handle)
            sched[nr.handle] = nr.num_scheduled_tokens
        for rr in so.resumed_reqs:
            st = self.reqs[rr.handle]
            st.tables, st.num_computed = self._split(unpack(rr.block_ids)), rr.num_computed_tokens
            self.running.add(rr.handle)
            sched[rr.handle] = rr.num_scheduled_tokens
        cr = so.cached_reqs
        flat, pos = unpack(cr.new_block_ids), 0
        for h, c in zip(unpack(cr.handles), unpack(cr.new_block_counts), strict=True):
            for table in self.reqs[h].tables:
                table.extend(flat[pos : pos + c])
                pos += c
        assert pos == len(flat)
        overrides = dict(zip(unpack(so.sched_override_handles),
                             unpack(so.sched_override_counts), strict=True))
        for h in self.running:
            if h not in sched:
                sched[h] = overrides.get(h, 1)
        handles, toks = [], []
        for h, n in sched.items():
            st = self.reqs[h]
            for p in range(st.num_computed, st.num_computed + n):
                self._compute(st, p)
            st.num_computed += n
            if n and st.num_computed >= len(st.tokens):
                tok = next_token(st.tokens)
                st.tokens.append(tok)
                handles.append(h)
                toks.append(tok)
        return ModelRunnerOutput(step_id=so.step_id, rank=0, req_handles=pack(handles),
                                 sampled_token_ids=pack(toks))

    def _compute(self, st: _Req, p: int) -> None:
        for table, w in zip(st.tables, self.windows, strict=True):
            first = max(0, p - w + 1) if w else 0
            for k in range(first, p):  # every key this layer kind reads
                got = self.kv.get((table[k // BS], k % BS))
                assert got == hash(tuple(st.tokens[: k + 1])), f"key {k} of position {p}"
        for table in st.tables:
            assert table[p // BS] != 0, f"position {p} written to the null block"
            self.kv[(table[p // BS], p % BS)] = hash(tuple(st.tokens[: p + 1]))


def _scheduler(groups: list[KVCacheGroupSpec], num_blocks: int, budget: int,
               **cfg: object) -> Scheduler:
    config = EngineConfig(block_size=BS, debug_invariants=True, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, num_blocks, 4096, budget, None, kv_cache_groups=groups)


def _run(sched: Scheduler, worker: GroupWorker, max_steps: int = 20_000) -> dict[str, list]:
    outs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        so = sched.schedule()
        for o in sched.update_from_output(so, worker.step(so)) + sched.take_outputs():
            assert o.finish_reason in (None, "length"), o.error
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        sched.check_invariants()
        for m in sched.kv_cache_manager.window_managers:
            for rid in m.req_to_blocks:
                assert m.num_live_blocks(rid) <= m.max_blocks(sched.requests[rid].num_tokens + 1)
    raise AssertionError("requests did not finish")


def _expected(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt) :]


HYBRID = kv_cache_groups([0, 8, 0, 8])  # two groups of two layers: full, window 8
MISTRAL = kv_cache_groups([8, 8])  # one group, windowed
TWO_WINDOWS = kv_cache_groups([5, 12])


# (groups, KV blocks small enough that four requests preempt each other)
@pytest.mark.parametrize("groups,num_blocks", [(HYBRID, 40), (MISTRAL, 9), (TWO_WINDOWS, 16)],
                         ids=["hybrid", "mistral", "two-windows"])
@pytest.mark.parametrize("opts", [dict(), dict(async_scheduling=True),
                                  dict(scheduler_reserve_full_isl=True)],
                         ids=["sync", "async", "gate"])
def test_windows_prefix_hits_and_preemption_keep_every_visible_key(groups, num_blocks,
                                                                   opts) -> None:
    """Shared prefixes (hits), a second identical round, chunked prefill under a 12-token
    budget and a cache small enough to preempt: every key a layer reads is the right one."""
    sched = _scheduler(groups, num_blocks, 12, **opts)
    worker = GroupWorker([g.sliding_window for g in groups])
    shared = list(range(100, 125))
    prompts = [shared + [7, 8, 9], shared[:17], list(range(200, 239)), shared + [1] * 9]
    for rnd in range(2):
        for i, p in enumerate(prompts):
            sched.add_request(Request(f"r{rnd}-{i}", p, SamplingParams(max_tokens=20,
                                                                        ignore_eos=True),
                                      None, 0.0))
        outs = _run(sched, worker)
        for i, p in enumerate(prompts):
            assert outs[f"r{rnd}-{i}"] == _expected(p, 20)
    stats = sched.get_stats()
    assert stats["prefix_cache_hits"] > 0
    if not opts:
        assert stats["num_preemptions"] > 0


def test_long_sequence_holds_a_bounded_number_of_window_blocks() -> None:
    """A 200-token prompt decoding 600 tokens: the full-attention group holds every block, the
    window group at most a window's worth plus a step (here 6 of 200 blocks)."""
    sched = _scheduler(HYBRID, 400, 16)
    worker = GroupWorker([0, 8])
    sched.add_request(Request("long", list(range(10, 210)),
                              SamplingParams(max_tokens=600, ignore_eos=True), None, 0.0))
    kvm = sched.kv_cache_manager
    full, window = kvm.managers
    peak_window = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, worker.step(so))
        if "long" in window.req_to_blocks:
            peak_window = max(peak_window, window.num_live_blocks("long"))
            decoding = sched.requests["long"].num_computed_tokens > 200
            if decoding:
                # the decode window: keys (p - 8, p] span at most 3 blocks, plus the next one
                assert window.num_live_blocks("long") <= 4
    assert peak_window <= window.max_blocks(800) == 7
    assert kvm.num_freed_by_window[1] >= 190 and kvm.num_freed_by_window[0] == 0
    assert kvm.num_held_blocks == 0 and kvm.num_free_blocks == 399
