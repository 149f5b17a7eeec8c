"""Property test of the KV offload tiers: random evictions, restores, prefetches, load reports
(some failing) and resets on a KVOffloadManager, with the planned copies executed on a
simulated device pool, host pool and disk in the workers' order, after a trip over the wire.

Bytes are modelled as (block hash, instance): a device block gets a new instance whenever a
forward computes it. Checked after every step: slots never leak, a hash in two tiers holds
identical bytes in both, every ready tier entry holds bytes that were offloaded under its hash,
and every restore writes such bytes into the device block it names.
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine_core.kv_offload import KVOffloadManager, block_hash_tag
from protocol.codec import Decoder, Encoder
from protocol.kv_transfer import KVTransfers, decode_transfers

NUM_DEVICE = 8
HASHES = list(range(100, 112))
GARBAGE = ("garbage", -1)  # what a failed disk read leaves in a host slot
Bytes = tuple[object, int]

_enc = Encoder()
_dec: Decoder[KVTransfers] = Decoder(KVTransfers)

op = st.one_of(
    st.tuples(st.just("compute"), st.integers(1, NUM_DEVICE - 1), st.sampled_from(HASHES)),
    st.tuples(st.just("evict"), st.integers(1, NUM_DEVICE - 1)),
    st.tuples(st.just("restore"), st.lists(st.sampled_from(HASHES), min_size=1, max_size=4,
                                           unique=True),
              st.lists(st.integers(1, NUM_DEVICE - 1), min_size=4, max_size=4, unique=True)),
    st.tuples(st.just("prefetch"), st.lists(st.sampled_from(HASHES), min_size=1, max_size=4,
                                            unique=True)),
    st.tuples(st.just("preempt"), st.lists(st.integers(1, NUM_DEVICE - 1), min_size=1,
                                           max_size=3, unique=True)),
)


class OffloadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVOffloadManager(num_host_blocks=3, num_disk_blocks=4, bytes_per_block=10)
        self.instances = 0
        # device block -> (registered hash or None, bytes)
        self.dev_hash: dict[int, object] = {}
        self.dev_mem: dict[int, Bytes] = {}
        self.host_mem: dict[int, Bytes] = {}
        self.disk_mem: dict[int, Bytes] = {}
        self.offloaded: dict[object, set[Bytes]] = {}  # hash -> every instance copied to host
        self.reads: dict[int, Bytes] = {}  # host slot -> bytes its pending disk read will give
        # this step: forward writes and expected restores, device block -> hash
        self.forward: dict[int, object] = {}
        self.expect: dict[int, object] = {}

    @initialize(host=st.integers(1, 4), disk=st.integers(0, 4))
    def sizes(self, host: int, disk: int) -> None:
        # tiny tiers make same-step slot reuse (and its hazards) common
        self.m = KVOffloadManager(num_host_blocks=host, num_disk_blocks=disk, bytes_per_block=10)

    # --------------------------------------------------------------------- the scheduler side

    def _drop_device(self, d: int) -> None:
        """The block pool reuses d: a cached block is offered to the tier first."""
        h = self.dev_hash.pop(d, None)
        if h is not None:
            self.m.on_device_evict(h, d)
        self.forward.pop(d, None)
        self.expect.pop(d, None)

    def _apply(self, o: tuple) -> None:
        kind = o[0]
        if kind == "compute":
            _, d, h = o
            self._drop_device(d)
            self.m.mark_uncomputed([d])
            self.forward[d] = h
            self.dev_hash[d] = h
        elif kind == "evict":
            self._drop_device(o[1])
        elif kind == "restore":
            _, hashes, devs = o
            n = self.m.lookup(hashes).num_ready
            assert self.m.reserve_restore(hashes) == n
            if n == 0:
                return
            for d in devs[:n]:
                self._drop_device(d)
            copies = self.m.plan_restore(hashes[:n], devs[:n])
            assert [c.device_block_id for c in copies] == devs[:n]
            for h, d in zip(hashes[:n], devs[:n], strict=True):
                self.expect[d] = h
                self.dev_hash[d] = h
        elif kind == "prefetch":
            lk = self.m.lookup(o[1])
            started = self.m.prefetch(o[1])
            assert started <= lk.num_on_disk
        elif kind == "preempt":
            devs = [d for d in o[1] if d in self.dev_hash]
            self.m.offload_request([self.dev_hash[d] for d in devs], devs)

    @rule(ops=st.lists(op, max_size=6), data=st.data())
    def step(self, ops: list[tuple], data: st.DataObject) -> None:
        for o in ops:
            self._apply(o)
        self._run_step()
        self.report_loads(data)  # the workers' report arrives with the step's output

    def report_loads(self, data: st.DataObject) -> None:
        slots = sorted(self.reads)
        if not slots:
            return
        fate = {s: data.draw(st.sampled_from(["wait", "ok", "fail"])) for s in slots}
        settled = [s for s in slots if fate[s] != "wait"]
        failed = [s for s in slots if fate[s] == "fail"]
        slot_hash = {e.slot: e.block_hash for e in self.m.host}
        for s in settled:
            value = self.reads.pop(s)
            self.host_mem[s] = GARBAGE if s in failed else value
        self.m.complete_loads([s for s in settled if s not in failed], failed)
        for s in failed:  # an unusable record is gone from both tiers
            assert slot_hash[s] not in self.m.host and slot_hash[s] not in self.m.disk

    @rule()
    def reset(self) -> None:
        busy = bool(self.m.num_loads_in_flight)
        assert self.m.reset() == (not busy)

    # --------------------------------------------------------------------- the workers' side

    def _run_step(self) -> None:
        wire = self.m.take_transfers()
        expect, self.expect = self.expect, {}
        forward, self.forward = self.forward, {}
        if wire is not None:
            t = decode_transfers(_dec.decode(_enc.encode(wire)))
            snapshots = [(x, self.host_mem.get(s, GARBAGE)) for s, x in t.host_to_disk]
            for x, value in snapshots:
                self.disk_mem[x] = value
            for x, s in t.disk_to_host:
                self.reads[s] = self.disk_mem.get(x, GARBAGE)
                self.host_mem[s] = GARBAGE  # being written in the background
            for d, s in t.device_to_host:
                value = self.dev_mem.get(d, GARBAGE)
                self.host_mem[s] = value
                self.offloaded.setdefault(value[0], set()).add(value)
            for s, d in t.host_to_device:
                assert s not in self.reads, "restore from a slot whose read is unconfirmed"
                self.dev_mem[d] = self.host_mem.get(s, GARBAGE)
        for d, h in expect.items():
            value = self.dev_mem.get(d)
            assert value is not None and value[0] == h, f"block {d} restored {value}, not {h}"
            assert value in self.offloaded[h], "restored bytes were never offloaded"
        for d, h in forward.items():
            self.instances += 1
            self.dev_mem[d] = (h, self.instances)

    # --------------------------------------------------------------------- invariants

    @invariant()
    def accounting(self) -> None:
        self.m.check_invariants()

    @invariant()
    def tier_bytes(self) -> None:
        if self.m.has_transfers():
            return  # mid-step (never between rules: every step rule runs its step)
        for e in self.m.host:
            if e.loading:
                assert e.slot in self.reads
                continue
            value = self.host_mem.get(e.slot)
            assert value is not None and value[0] == e.block_hash, (e, value)
            assert value in self.offloaded[e.block_hash]
            record = self.m.disk.get(e.block_hash)
            if record is not None:
                assert self.disk_mem.get(record.slot) == value, "two tiers, different bytes"
        for r in self.m.disk:
            value = self.disk_mem.get(r.slot)
            assert value is not None and value[0] == r.block_hash, (r, value)
            assert value in self.offloaded[r.block_hash]

    @invariant()
    def stats_add_up(self) -> None:
        s = self.m.stats()
        assert s["kv_offload_host_blocks"] <= s["kv_offload_host_capacity"]
        assert s["kv_offload_disk_blocks"] <= s["kv_offload_disk_capacity"]
        assert s["kv_offload_bytes_device_to_host"] % 10 == 0

    def teardown(self) -> None:
        # what the run exercised (pytest --hypothesis-show-statistics)
        for key in ("host_hits", "disk_hits", "spilled", "dropped", "declined",
                    "load_failures"):
            if self.m.counters[key]:
                event(f"{key} > 0")


TestOffloadMachine = OffloadMachine.TestCase
TestOffloadMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_block_hash_tags() -> None:
    import hashlib

    h = hashlib.sha256(b"x").digest()
    assert block_hash_tag(h) == int.from_bytes(h[:8], "little")
    assert block_hash_tag(-1) == 2**64 - 1
    # per-group keys of the block pool differ from group 0's and from each other
    tags = {block_hash_tag(h), block_hash_tag((h, 1)), block_hash_tag((h, 2))}
    assert len(tags) == 3 and all(0 <= t < 2**64 for t in tags)
